package gateway

import (
	"fmt"
	"strings"
	"testing"
)

// A req_id's destinations are bounded (idempotency.max_destinations_per_req_id):
// one more is refused with a 400 envelope naming the bound, before it
// reaches the encoder, and counted; the destinations done still replay.
func TestSendPastTheDestinationBoundIs400(t *testing.T) {
	encs := startFakes(t, 1, nil)
	g := startGateway(t, fakeURLs(encs), func(c *Config) { c.Idempotency.MaxDestinationsPerReqID = 4 })
	const id = "wide_local_part_0"
	if a := post(t, g.base+"/encode", encodeBody(id)); a.status != 200 {
		t.Fatalf("encode %d %s", a.status, a.body)
	}
	// receive_count 8: the req_id is not released before the bound.
	for rank := range 4 {
		if a := post(t, g.base+"/send", tpSend(id, rank, 8)); a.status != 200 {
			t.Fatalf("rank %d: %d %s", rank, a.status, a.body)
		}
	}
	a := post(t, g.base+"/send", tpSend(id, 4, 8))
	if a.status != 400 || !strings.Contains(a.body, "idempotency.max_destinations_per_req_id") ||
		!strings.Contains(a.body, "already has 4 destinations") || !strings.Contains(a.body, `"req_id":"`+id+`"`) ||
		a.header.Get("Content-Type") != "application/json" || a.header.Get(headerReplayed) != "" {
		t.Fatalf("a fifth destination: %d %s %v", a.status, a.body, a.header)
	}
	if got := sendsReceived(encs[0], id); got != 4 {
		t.Fatalf("encoder received %d /sends, want 4", got)
	}
	if got := metricValue(t, g, "encgate_send_destinations_refused_total"); got != 1 {
		t.Errorf("encgate_send_destinations_refused_total = %v", got)
	}
	if a := post(t, g.base+"/send", tpSend(id, 2, 8)); a.status != 200 || a.header.Get(headerReplayed) != "true" {
		t.Fatalf("a done destination: %d %s", a.status, a.body)
	}
}

// Ranks that disagree on receive_count get from the gateway what they get
// from the encoder itself (sglang NEW: each /send compares the distinct
// destinations counted so far with its own receive_count): the same
// status and body for every /send, in order.
func TestRanksDisagreeingOnReceiveCountGetTheEncodersAnswers(t *testing.T) {
	sequences := [][]int{{2, 3, 3}, {1, 2}, {4, 2, 5}, {0, 2, 2}, {3, 0, 3, 3, 1}}
	direct := startFakes(t, 1, nil)[0]
	behind := startFakes(t, 1, nil)
	g := startGateway(t, fakeURLs(behind), nil)
	for i, counts := range sequences {
		id := fmt.Sprintf("ranks%d_local_part_0", i)
		for _, base := range []string{direct.URL(), g.base} {
			if a := post(t, base+"/encode", encodeBody(id)); a.status != 200 {
				t.Fatalf("encode via %s: %d %s", base, a.status, a.body)
			}
		}
		for rank, rc := range counts {
			body := tpSend(id, rank, rc)
			want := post(t, direct.URL()+"/send", body)
			got := post(t, g.base+"/send", body)
			if got.status != want.status || got.body != want.body {
				t.Errorf("receive_counts %v, rank %d (%d): gateway %d %s, encoder %d %s",
					counts, rank, rc, got.status, got.body, want.status, want.body)
			}
		}
	}
}
