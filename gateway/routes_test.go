package gateway

import (
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/encgate/encgate/fakeencoder"
	"github.com/encgate/encgate/upstream"
)

// rankEncodeBody is a GEN0 receiver rank's own /encode (protocol reference
// §11): the tokenizer's fields plus the rank's embedding_port and
// receive_count.
func rankEncodeBody(id string, port, count int) string {
	return fmt.Sprintf(`{"encoder_idx":0,"mm_items":["https://example.com/a.png"],"num_parts":1,"part_idx":0,"req_id":%q,`+
		`"modality":"IMAGE","prefill_host":"10.0.0.1","embedding_port":%d,"receive_count":%d}`, id, port, count)
}

// Every route, in front of a fleet of each sglang generation (NEW, GEN1,
// GEN0; protocol reference §11, §12), with no generation key: what reaches
// the encoder, what comes back, that no answer in any generation's
// ordinary traffic counts against a breaker, and what the gateway learned
// of the encoder holding the part.
func TestRoutesAgainstBothGenerations(t *testing.T) {
	for _, gen := range []struct {
		name  string
		fake  fakeencoder.Generation
		guess string // Learned().Guess of the holder at the end
	}{{"new", fakeencoder.GenNew, ""}, {"gen1", fakeencoder.Gen1, ""}, {"gen0", fakeencoder.Gen0, "gen0"}} {
		t.Run(gen.name, func(t *testing.T) {
			encs := startFakes(t, 2, func(_ int, o *fakeencoder.Options) { o.Generation = gen.fake })
			g := startGateway(t, fakeURLs(encs), func(c *Config) {
				c.Affinity.UnknownWait = 0
				c.Breaker.ConsecutiveFailures = 1
				for _, e := range c.Encoders {
					if e.Generation != upstream.GenAuto {
						t.Fatalf("encoder %s has generation %q", e.Name, e.Generation)
					}
				}
			})
			old := gen.fake == fakeencoder.Gen0
			const id = "route_local_part_0"

			// /encode: the tokenizer's (NEW), or each of the TP=2 ranks' (GEN0).
			if old {
				for port := 40000; port < 40002; port++ {
					if a := post(t, g.base+"/encode", rankEncodeBody(id, port, 2)); a.status != 200 || !strings.Contains(a.body, `"embedding_size":`) {
						t.Fatalf("rank /encode: %d %s", a.status, a.body)
					}
				}
			} else if a := post(t, g.base+"/encode", encodeBody(id)); a.status != 200 || !strings.Contains(a.body, `"embedding_size":`) {
				t.Fatalf("/encode: %d %s", a.status, a.body)
			}
			holder := g.Pool().Encoders()[0].Name
			if pin, _ := g.Pool().Pin(id); pin.State != upstream.PinEncoded {
				t.Fatalf("pin %+v", pin)
			} else {
				holder = pin.Encoder
			}

			// The metadata pull: NEW answers it; GEN0 has no such route and
			// its 404 passes through.
			a := post(t, g.base+"/scheduler_receive_meta_data", metaBody(id))
			if old && (a.status != 404 || a.body != `{"detail":"Not Found"}`) || !old && a.status != 200 {
				t.Fatalf("metadata: %d %s", a.status, a.body)
			}

			// /send per rank; the second releases the part and its pin.
			for port := 40000; port < 40002; port++ {
				if a := post(t, g.base+"/send", sendBody(id, port)); a.status != 200 || a.body != "null" {
					t.Fatalf("/send %d: %d %s", port, a.status, a.body)
				}
			}
			if _, pinned := g.Pool().Pin(id); pinned {
				t.Fatal("the part stayed pinned after its last /send")
			}
			wantEnvelopeMsg(t, post(t, g.base+"/send", sendBody(id, 40002)), 500,
				"no staged embedding for req_id="+id+" (already released)", strp(id))

			// A /send for a req_id nobody encoded reaches the encoder: NEW's
			// envelope, GEN0's KeyError text, GEN1's uncaught exception
			// (the same text, §12); none is a fault.
			a = post(t, g.base+"/send", sendBody("nobody_local_part_0", 40000))
			plain := gen.fake != fakeencoder.GenNew
			if a.status != 500 || plain && a.body != "Internal Server Error" || !plain && !strings.Contains(a.body, "(already released)") {
				t.Fatalf("/send of an unknown req_id: %d %s", a.status, a.body)
			}

			// A registration that comes before its /encode: NEW holds it
			// (here until the part's /encode), GEN0 stores it at once.
			const reg = "reg_local_part_0"
			if old {
				if a := post(t, g.base+"/scheduler_receive_url", registerBody(reg, "10.0.0.1:5000", 1)); a.status != 200 || a.body != "null" {
					t.Fatalf("early registration: %d %s", a.status, a.body)
				}
			}

			// A failed /encode: its follow-ups get its answer at once.
			const bad = "bad_local_part_0"
			body := strings.Replace(encodeBody(bad), `"https://example.com/a.png"`, `"fail:400:Error while loading data https://x/missing.png: 404"`, 1)
			wantEnvelopeMsg(t, post(t, g.base+"/encode", body), 400, "Error while loading data https://x/missing.png: 404", strp(bad))
			wantEnvelopeMsg(t, post(t, g.base+"/send", sendBody(bad, 40000)), 400, "Error while loading data https://x/missing.png: 404", strp(bad))
			for _, e := range encs {
				if n := e.Stats().ReqIDs[bad]["/send"]; n != 0 {
					t.Fatalf("%s received the failed part's /send", e.Stats().Name)
				}
			}

			// Health and profile are the fleet's.
			if a := do(t, http.MethodGet, g.base+"/health", ""); a.status != 200 {
				t.Fatalf("/health: %d", a.status)
			}
			if a := post(t, g.base+"/start_profile", ""); a.status != 200 || strings.Count(a.body, "Start profiling.") != 2 {
				t.Fatalf("/start_profile: %d %q", a.status, a.body)
			}

			for _, e := range g.Pool().Encoders() {
				if st, c := e.Breaker.State(), e.Breaker.Counts(); st != upstream.BreakerClosed || c.TotalFailures != 0 {
					t.Fatalf("%s (holding the part: %v): breaker %s, counts %+v", e.Name, e.Name == holder, st, c)
				}
			}
			e, _ := g.Pool().Lookup(holder)
			l := e.Learned()
			if want := map[bool]upstream.Fact{true: upstream.No, false: upstream.Yes}[old]; l.ServesMetadata != want || l.Guess != gen.guess {
				t.Fatalf("learned of %s: %+v, want serves_metadata %s, guess %q", holder, l, want, gen.guess)
			}
			t.Logf("learned of %s: %+v", holder, l)
		})
	}
}
