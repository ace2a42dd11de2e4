package gateway

import (
	"fmt"
	"testing"

	"github.com/encgate/encgate/fakeencoder"
	"github.com/encgate/encgate/upstream"
)

func encodeMediaBody(id, mmItems string) string {
	return fmt.Sprintf(`{"req_id":%q,"mm_items":%s,"modality":"IMAGE","num_parts":1,"part_idx":0,"prefill_host":"10.0.0.1","embedding_port":null}`, id, mmItems)
}

// reqIDsOwnedApart returns two req_ids whose rendezvous owners differ.
func reqIDsOwnedApart(t *testing.T, g *gw) (string, string) {
	t.Helper()
	first, err := g.pool.Owner("turn-0_local_part_0")
	if err != nil {
		t.Fatal(err)
	}
	for i := 1; i < 1000; i++ {
		id := fmt.Sprintf("turn-%d_local_part_0", i)
		if o, _ := g.pool.Owner(id); o.Name != first.Name {
			return "turn-0_local_part_0", id
		}
	}
	t.Fatal("no two req_ids with different owners")
	return "", ""
}

func cacheHits(encs []*fakeencoder.Encoder) (hits, misses int64) {
	for _, e := range encs {
		st := e.Stats()
		hits, misses = hits+st.CacheHits, misses+st.CacheMisses
	}
	return hits, misses
}

// With affinity.encode_by content the same image sent again under a new
// req_id (the next turn of a conversation) reaches the encoder that encoded
// it, whose media cache answers it; the new req_id is pinned there and its
// follow-ups go there. With the default, req_id, it goes to its req_id's
// owner, another encoder here, and misses.
func TestContentAffinityReachesTheEncoderThatCachedTheMedia(t *testing.T) {
	const image = `["https://img.example/conv-17/img-3.png"]`
	for _, mode := range []string{upstream.EncodeByReqID, upstream.EncodeByContent} {
		t.Run(mode, func(t *testing.T) {
			encs := startFakes(t, 4, func(_ int, o *fakeencoder.Options) { o.CacheItems = 100 })
			g := startGateway(t, fakeURLs(encs), func(c *Config) { c.Affinity.EncodeBy = mode })
			a, b := reqIDsOwnedApart(t, g)
			var on []string
			for _, id := range []string{a, b} {
				ans := post(t, g.base+"/encode", encodeMediaBody(id, image))
				if ans.status != 200 {
					t.Fatalf("%s /encode: %d %s", id, ans.status, ans.body)
				}
				enc := ans.header.Get(headerEncoder)
				on = append(on, enc)
				if m := post(t, g.base+"/scheduler_receive_meta_data", metaBody(id)); m.status != 200 || m.header.Get(headerEncoder) != enc {
					t.Fatalf("%s: metadata %d on %q, want 200 on its /encode's %s", id, m.status, m.header.Get(headerEncoder), enc)
				}
			}
			hits, misses := cacheHits(encs)
			switch mode {
			case upstream.EncodeByContent:
				if on[0] != on[1] || hits != 1 || misses != 1 {
					t.Errorf("content: the image went to %v, cache hits %d misses %d; want one encoder, 1 hit, 1 miss", on, hits, misses)
				}
			default:
				oa, _ := g.pool.Owner(a)
				ob, _ := g.pool.Owner(b)
				if on[0] != oa.Name || on[1] != ob.Name || hits != 0 || misses != 2 {
					t.Errorf("req_id: the image went to %v (owners %s, %s), cache hits %d misses %d; want the owners, 0 hits, 2 misses",
						on, oa.Name, ob.Name, hits, misses)
				}
			}
		})
	}
}
