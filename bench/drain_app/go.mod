module drainapp

go 1.22
