package gateclient

// Helpers of the package's own tests that the external ones (client_test.go,
// which runs the agent's real server from internal/gaterpc, which imports this
// package) use too.
var (
	TestInterfaces = testInterfaces
	PBInterfaces   = pbInterfaces
)
