//go:build !race

package gateway

// memoryReqIDs is how many distinct req_ids TestChaosMemoryBoundedMillionReqIDs
// drives.
const memoryReqIDs = 1_000_000
