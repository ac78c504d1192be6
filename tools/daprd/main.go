// Command daprd is the upstream Dapr sidecar, built from Go modules so the
// end-to-end tests and the demo have a real daprd on machines without the
// Dapr CLI. Nothing here changes daprd's behaviour.
package main

import "github.com/dapr/dapr/cmd/daprd/app"

func main() {
	app.Run()
}
