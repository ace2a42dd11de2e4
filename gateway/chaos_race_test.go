//go:build race

package gateway

// memoryReqIDs is how many distinct req_ids TestChaosMemoryBoundedMillionReqIDs
// drives: 10^5 under the race detector, which makes each one about ten times
// dearer (10^6 would take most of a minute on two cores).
const memoryReqIDs = 100_000
