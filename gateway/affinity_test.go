package gateway

import (
	"fmt"
	"sync"
	"testing"

	"github.com/encgate/encgate/fakeencoder"
)

func encodeBody(id string) string {
	return fmt.Sprintf(`{"req_id":%q,"mm_items":["https://example.com/a.png"],"modality":"IMAGE","num_parts":1,"part_idx":0,"prefill_host":"10.0.0.1","embedding_port":null}`, id)
}

func metaBody(id string) string { return fmt.Sprintf(`{"req_id":%q,"part_idx":0}`, id) }

func registerBody(id, url string, count int) string {
	return fmt.Sprintf(`{"req_id":%q,"receive_count":%d,"receive_url":%q,"modality":"IMAGE"}`, id, count, url)
}

func sendBody(id string, port int) string {
	return fmt.Sprintf(`{"req_id":%q,"part_idx":0,"embedding_size":524288,"embedding_len":256,"embedding_dim":1024,"prefill_host":"10.0.0.1","embedding_port":%d,"session_id":"10.0.0.1:17000","buffer_address":140737488355328,"receive_count":2}`, id, port)
}

// owners maps each req_id to the encoders that saw it.
func owners(encs []*fakeencoder.Encoder) map[string][]string {
	out := map[string][]string{}
	for _, e := range encs {
		st := e.Stats()
		for id := range st.ReqIDs {
			out[id] = append(out[id], st.Name)
		}
	}
	return out
}

func TestEveryCallForAReqIDStaysOnItsEncoder(t *testing.T) {
	encs := startFakes(t, 3, nil)
	g := startGateway(t, fakeURLs(encs), nil)
	const n = 30
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			id := fmt.Sprintf("req-%d_local_part_0", i)
			a := post(t, g.base+"/encode", encodeBody(id))
			if a.status != 200 {
				t.Errorf("%s /encode: %d %s", id, a.status, a.body)
				return
			}
			pinned := a.header.Get("X-Encgate-Encoder")
			for rank := 0; rank < 2; rank++ {
				m := post(t, g.base+"/scheduler_receive_meta_data", metaBody(id))
				s := post(t, g.base+"/send", sendBody(id, 40000+rank))
				if m.status != 200 || s.status != 200 {
					t.Errorf("%s rank %d: metadata %d %s, send %d %s", id, rank, m.status, m.body, s.status, s.body)
				}
				if m.header.Get("X-Encgate-Encoder") != pinned || s.header.Get("X-Encgate-Encoder") != pinned {
					t.Errorf("%s: follow-ups left %s", id, pinned)
				}
			}
		}()
	}
	wg.Wait()
	seen := owners(encs)
	if len(seen) != n {
		t.Fatalf("encoders saw %d req_ids, want %d", len(seen), n)
	}
	used := map[string]bool{}
	for id, on := range seen {
		if len(on) != 1 {
			t.Errorf("%s reached %v", id, on)
		}
		used[on[0]] = true
	}
	if len(used) < 2 {
		t.Errorf("all %d req_ids went to %v: no spread", n, used)
	}
	// Both ranks' /sends completed receive_count=2, so every req_id was
	// released and its pin dropped.
	if got := g.Pool().PinsHeld(); got != 0 {
		t.Errorf("pins = %d after every req_id was released, want 0", got)
	}
}

func TestFollowUpBeforeEncodeWaitsForThePin(t *testing.T) {
	encs := startFakes(t, 3, nil)
	g := startGateway(t, fakeURLs(encs), nil)
	const id = "early_local_part_0"
	got := make(chan answer, 1)
	go func() { got <- post(t, g.base+"/scheduler_receive_meta_data", metaBody(id)) }()
	eventually(t, "the follow-up to wait for a pin", func() bool { return g.Pool().PinWaiters() == 1 })
	for _, e := range encs {
		if n := e.Stats().Routes["/scheduler_receive_meta_data"]; n != 0 {
			t.Fatalf("%s got the follow-up before the /encode was pinned", e.Stats().Name)
		}
	}
	enc := post(t, g.base+"/encode", encodeBody(id))
	meta := <-got
	if enc.status != 200 || meta.status != 200 {
		t.Fatalf("encode %d %s; metadata %d %s", enc.status, enc.body, meta.status, meta.body)
	}
	if meta.header.Get("X-Encgate-Encoder") != enc.header.Get("X-Encgate-Encoder") {
		t.Fatalf("metadata on %s, encode on %s", meta.header.Get("X-Encgate-Encoder"), enc.header.Get("X-Encgate-Encoder"))
	}
	if on := owners(encs)[id]; len(on) != 1 {
		t.Fatalf("req_id reached %v", on)
	}
}

func TestFollowUpWithoutPinUsesRendezvousOwner(t *testing.T) {
	encs := startFakes(t, 3, nil)
	g := startGateway(t, fakeURLs(encs), func(c *Config) { c.Affinity.UnknownWait = 0 })
	const id = "no-wait_local_part_1"
	// The follow-up goes first and finds no pin; it still lands where the
	// /encode will, because both use the same rendezvous order. The fake
	// encoder holds the metadata pull until the /encode publishes.
	got := make(chan answer, 1)
	go func() { got <- post(t, g.base+"/scheduler_receive_meta_data", metaBody(id)) }()
	eventually(t, "the pull to reach an encoder", func() bool {
		n := int64(0)
		for _, e := range encs {
			n += e.Stats().Routes["/scheduler_receive_meta_data"]
		}
		return n == 1
	})
	enc := post(t, g.base+"/encode", encodeBody(id))
	meta := <-got
	if enc.status != 200 || meta.status != 200 {
		t.Fatalf("encode %d; metadata %d %s", enc.status, meta.status, meta.body)
	}
	if on := owners(encs)[id]; len(on) != 1 {
		t.Fatalf("req_id reached %v", on)
	}
}
