module github.com/dapr-delayed-pubsub/tools/daprd

go 1.26.4

// v1.18.1: the newest v1.18 release whose whole dependency graph the Go module
// proxy serves here (v1.18.2/3 need durabletask-go and pulsar forks it refuses).
require github.com/dapr/dapr v1.18.1

// Go ignores the replace directives of dependencies, so daprd's own are
// repeated here, as dapr/dapr v1.18.1's go.mod has them.
replace (
	dubbo.apache.org/dubbo-go/v3 => dubbo.apache.org/dubbo-go/v3 v3.0.3-0.20230118042253-4f159a2b38f3
	gopkg.in/couchbaselabs/gocbconnstr.v1 => github.com/couchbaselabs/gocbconnstr v1.0.5
)

replace (
	github.com/chenzhuoyu/iasm => github.com/chenzhuoyu/iasm v0.9.0
	github.com/chzyer/logex => github.com/chzyer/logex v1.2.1
	github.com/gobwas/pool => github.com/gobwas/pool v0.2.1
	github.com/toolkits/concurrent => github.com/niean/gotools v0.0.0-20151221085310-ff3f51fc5c60
)
