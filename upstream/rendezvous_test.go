package upstream

import (
	"fmt"
	"testing"

	"github.com/cespare/xxhash/v2"
)

func encs(names ...string) []*Encoder {
	out := make([]*Encoder, len(names))
	for i, n := range names {
		out[i] = &Encoder{Name: n, hash: xxhash.Sum64String(n)}
	}
	return out
}

func TestRankDeterministicAndComplete(t *testing.T) {
	fleet := encs("a", "b", "c", "d")
	r1 := rank("req-1_local_part_0", fleet, nil)
	r2 := rank("req-1_local_part_0", []*Encoder{fleet[3], fleet[1], fleet[0], fleet[2]}, nil)
	if len(r1) != 4 {
		t.Fatalf("rank dropped encoders: %d", len(r1))
	}
	for i := range r1 {
		if r1[i].Name != r2[i].Name {
			t.Fatalf("order depends on input order: %v vs %v", names(r1), names(r2))
		}
	}
}

func TestRankSpreadsAndMovesOnlyRemovedKeys(t *testing.T) {
	fleet := encs("enc-a", "enc-b", "enc-c", "enc-d")
	const n = 20000
	count := map[string]int{}
	moved := 0
	for i := 0; i < n; i++ {
		id := fmt.Sprintf("rid-%d_local_part_%d", i, i%3)
		owner := rank(id, fleet, nil)[0].Name
		count[owner]++
		without := rank(id, []*Encoder{fleet[0], fleet[1], fleet[3]}, nil)[0].Name // enc-c removed
		if owner != "enc-c" && without != owner {
			moved++
		}
		if owner == "enc-c" && without != rank(id, fleet, nil)[1].Name {
			t.Fatalf("%s: removed owner's keys must go to the next in order", id)
		}
	}
	if moved != 0 {
		t.Fatalf("%d keys moved although their owner stayed", moved)
	}
	for name, c := range count {
		if c < n/4*8/10 || c > n/4*12/10 {
			t.Errorf("%s owns %d of %d keys: outside ±20%% of even", name, c, n)
		}
	}
}

func TestRankAllocs(t *testing.T) {
	fleet := encs("a", "b", "c")
	buf := make([]*Encoder, 0, 8)
	if a := testing.AllocsPerRun(100, func() { rank("x", fleet, buf[:0]) }); a != 0 {
		t.Errorf("rank allocates %.0f times", a)
	}
}

func names(es []*Encoder) []string {
	out := make([]string, len(es))
	for i, e := range es {
		out[i] = e.Name
	}
	return out
}
