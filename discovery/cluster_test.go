package discovery

import (
	"testing"

	"github.com/encgate/encgate/internal/redistest"
)

// The registry on a real Redis Cluster (three masters made by redis-cli
// --cluster create): every script touches the keys of its prefix, the set
// and its health facts, which share one slot (sameSlotKey), so it runs on
// the node of that slot, and the registries agree as on one server. One cluster serves every subtest, each on flushed nodes.
func TestRegistryRedisOnCluster(t *testing.T) {
	c := redistest.StartCluster(t)
	for _, tc := range []struct {
		name string
		f    func(*testing.T, *regShape)
	}{
		{"Converge", testRegistryConverge},
		{"Bound", testRegistryBound},
		{"BoundConcurrent", testRegistryBoundConcurrent},
		{"TTL", testRegistryTTL},
		{"RefreshRacesUnregister", testRegistryRefreshRacesUnregister},
		{"ClockSkew", testRegistryClockSkew},
		{"Room", testRegistryRoomRedis},
	} {
		t.Run(tc.name, func(t *testing.T) { tc.f(t, regCluster(t, c)) })
	}
}
