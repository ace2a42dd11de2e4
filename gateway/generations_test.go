package gateway

// Real-socket tests of how the gateway judges and routes the exchanges of
// both sglang generations (protocol reference §11: GEN0; §1-§10: NEW): long
// polls held past their try, follow-ups refused before forwarding, GEN0's
// per-rank /encode dedupe and its sibling 500, a CUDA fault that must still
// open a breaker, GEN0's zmq error frame after a failed encode, and a good
// pin that outlives a later bad /encode.

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/encgate/encgate/fakeencoder"
	"github.com/encgate/encgate/gpuagent/acktest"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/upstream"
)

// heldEncodes is an EncodeHook that holds the /encodes whose req_id hold
// accepts until release, announcing each on entered. Every other /encode
// passes straight through.
type heldEncodes struct {
	hold    func(id string) bool
	entered chan string
	ch      chan struct{}
	once    sync.Once
}

func newHeldEncodes(t *testing.T, hold func(id string) bool) *heldEncodes {
	h := &heldEncodes{hold: hold, entered: make(chan string, 16), ch: make(chan struct{})}
	t.Cleanup(h.release) // if the test fails while one is held
	return h
}

func (h *heldEncodes) hook(ctx context.Context, id string) {
	if !h.hold(id) {
		return
	}
	select {
	case h.entered <- id:
	case <-ctx.Done():
		return
	}
	select {
	case <-h.ch:
	case <-ctx.Done():
	}
}

func (h *heldEncodes) release() { h.once.Do(func() { close(h.ch) }) }

// waitEntered waits for the hook to hold an /encode and returns its req_id.
func (h *heldEncodes) waitEntered(t *testing.T) string {
	t.Helper()
	select {
	case id := <-h.entered:
		return id
	case <-time.After(10 * time.Second):
		t.Fatal("no /encode reached the encode hook within 10s")
		return ""
	}
}

// callers is an HTTP client for concurrent calls, whose connections are
// closed before the gateway shuts down: make it after startGateway. A
// connection the transport dialled for one of several concurrent calls and
// never used (another call's connection came free first) would otherwise
// hold the gateway's Shutdown until fasthttp counts it idle, 5s after it
// opened.
type callers struct{ hc *http.Client }

func newCallers(t *testing.T) *callers {
	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	return &callers{hc: &http.Client{Transport: tr, Timeout: 30 * time.Second}}
}

// post posts body to url in the background.
func (c *callers) post(url, body string) <-chan result {
	out := make(chan result, 1)
	go func() {
		var r result
		defer func() { out <- r }()
		req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
		if err != nil {
			r.err = err
			return
		}
		req.Header.Set("Content-Type", "application/json")
		resp, err := c.hc.Do(req)
		if err != nil {
			r.err = err
			return
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		r.a, r.err = answer{resp.StatusCode, resp.Header, string(b)}, err
	}()
	return out
}

// await returns a callers.post result, failing the test on a transport
// error.
func await(t *testing.T, what string, ch <-chan result) answer {
	t.Helper()
	r := <-ch
	if r.err != nil {
		t.Fatalf("%s: %v", what, r.err)
	}
	return r.a
}

// answeredEarly reports whether one of the calls has an answer already.
func answeredEarly(calls []<-chan result) bool {
	for _, ch := range calls {
		if len(ch) > 0 {
			return true
		}
	}
	return false
}

// gen0RankBody is the /encode a GEN0 receiver TP rank posts itself in
// mooncake mode (§11): its own embedding_port and receive_count = TP size.
func gen0RankBody(id string, port, tp int, item string) string {
	return fmt.Sprintf(`{"encoder_idx":0,"mm_items":[%q],"num_parts":1,"part_idx":0,"req_id":%q,"modality":"IMAGE",`+
		`"prefill_host":"10.0.0.1","embedding_port":%d,"receive_count":%d}`, item, id, port, tp)
}

// tokenizerEncode is the tokenizer's /encode of one part with one mm_item,
// embedding_port null (zmq_to_scheduler and mooncake).
func tokenizerEncode(id, item string) string {
	return fmt.Sprintf(`{"req_id":%q,"mm_items":[%q],"modality":"IMAGE","num_parts":1,"part_idx":0,`+
		`"prefill_host":"127.0.0.1","embedding_port":null}`, id, item)
}

// allGen0 marks every configured encoder as sglang GEN0.
func allGen0(c *Config) {
	for i := range c.Encoders {
		c.Encoders[i].Generation = upstream.Gen0
	}
}

// embeddingSizes are the sizes of a mooncake /encode or metadata answer.
type embeddingSizes struct {
	Size int64 `json:"embedding_size"`
	Len  int64 `json:"embedding_len"`
	Dim  int64 `json:"embedding_dim"`
}

func sizesOf(t *testing.T, a answer) embeddingSizes {
	t.Helper()
	var s embeddingSizes
	if err := json.Unmarshal([]byte(a.body), &s); err != nil || s.Size == 0 {
		t.Fatalf("answer %d %q carries no embedding sizes (%v)", a.status, a.body, err)
	}
	return s
}

// breakerNoFault fails unless e's breaker is closed and counted no fault.
func breakerNoFault(t *testing.T, g *gw, e *upstream.Encoder) {
	t.Helper()
	if st, c := e.Breaker.State(), e.Breaker.Counts(); st != upstream.BreakerClosed || c.TotalFailures != 0 {
		t.Errorf("%s: breaker %v with counts %+v, want closed with no failure", e.Name, st, c)
	}
	if n := seriesValue(t, g, "encgate_breaker_outcomes_total", "encoder", e.Name, "outcome", "fault"); n != 0 {
		t.Errorf(`encgate_breaker_outcomes_total{encoder=%q,outcome="fault"} = %v, want 0`, e.Name, n)
	}
}

// Metadata pulls and registrations are long polls: the encoder holds them
// by design until the part's /encode comes (§1.2, §1.4). Twenty of each,
// for req_ids whose /encode never comes, held by the encoder past
// retry.<route>.per_try_timeout, are answered 504 by the gateway once their
// tries are spent (metadata retries a timeout within its deadline, a
// registration does not), and none of those expired tries counts against an
// encoder's breaker: every breaker stays closed with no failure, no outcome
// is a fault, and a fresh /encode with its follow-ups is served.
func TestHeldPullsPastPerTryTimeoutLeaveBreakersClosed(t *testing.T) {
	encs := startFakes(t, 2, func(_ int, o *fakeencoder.Options) {
		o.MetadataTimeout = time.Minute
		o.RegisterTimeout = time.Minute
	})
	g := startGateway(t, fakeURLs(encs), func(c *Config) {
		c.Health.Disabled = true
		c.Affinity.UnknownWait = 0
		c.Breaker.ConsecutiveFailures = 3
		for _, p := range []*upstream.RetryPolicy{&c.Retry.Metadata, &c.Retry.ReceiveURL} {
			p.PerTryTimeout = configfile.Duration(200 * time.Millisecond)
			p.Deadline = configfile.Duration(500 * time.Millisecond)
			p.MaxAttempts = 3
		}
	})
	cs := newCallers(t)
	const n = 20
	type held struct {
		id, path string
		ch       <-chan result
	}
	var calls []held
	for i := 0; i < n; i++ {
		id := fmt.Sprintf("never-pulled-%d_local_part_0", i)
		calls = append(calls, held{id, routeMetadata, cs.post(g.base+routeMetadata, metaBody(id))})
		id = fmt.Sprintf("never-registered-%d_local_part_0", i)
		calls = append(calls, held{id, "/scheduler_receive_url",
			cs.post(g.base+"/scheduler_receive_url", registerBody(id, "10.0.0.1:5000", 2))})
	}
	for _, c := range calls {
		a := await(t, c.path+" "+c.id, c.ch)
		msg := wantEnvelope(t, a, http.StatusGatewayTimeout, &c.id)
		if !strings.Contains(msg, "did not answer in time") && !strings.Contains(msg, "no time was left") {
			t.Errorf("%s %s: message %q does not say the encoder ran out of time", c.path, c.id, msg)
		}
	}
	eventually(t, "every held call to have reached an encoder", func() bool {
		seen := routesSeen(encs)
		return seen[routeMetadata] >= n && seen["/scheduler_receive_url"] >= n
	})
	for _, e := range g.Pool().Encoders() {
		breakerNoFault(t, g, e)
	}
	if f := seriesValue(t, g, "encgate_breaker_outcomes_total", "outcome", "fault"); f != 0 {
		t.Fatalf(`encgate_breaker_outcomes_total{outcome="fault"} = %v, want 0`, f)
	}
	if ign := seriesValue(t, g, "encgate_breaker_outcomes_total", "outcome", "ignored"); ign < 2*n {
		t.Errorf(`encgate_breaker_outcomes_total{outcome="ignored"} = %v, want every expired try (at least %d)`, ign, 2*n)
	}
	// New work is served, on whichever encoder owns it.
	const id = "fresh_local_part_0"
	enc := post(t, g.base+"/encode", encodeBody(id))
	if enc.status != 200 {
		t.Fatalf("fresh /encode: %d %s", enc.status, enc.body)
	}
	meta := post(t, g.base+routeMetadata, metaBody(id))
	if meta.status != 200 || sizesOf(t, meta) != sizesOf(t, enc) {
		t.Fatalf("fresh metadata pull: %d %s (encode answered %s)", meta.status, meta.body, enc.body)
	}
	if reg := post(t, g.base+"/scheduler_receive_url", registerBody(id, "10.0.0.1:5000", 2)); reg.status != 200 {
		t.Fatalf("fresh registration: %d %s", reg.status, reg.body)
	}
	for _, e := range g.Pool().Encoders() {
		breakerNoFault(t, g, e)
	}
}

// sendWith is a valid /send body for id with the fields in change replaced
// by their raw JSON value, or left out where the value is "".
func sendWith(id string, change map[string]string) string {
	fields := []struct{ k, v string }{
		{"req_id", strconv.Quote(id)}, {"part_idx", "0"}, {"embedding_size", "524288"},
		{"embedding_len", "256"}, {"embedding_dim", "1024"}, {"prefill_host", `"10.0.0.1"`},
		{"embedding_port", "40000"}, {"session_id", `"10.0.0.1:17000"`},
		{"buffer_address", "140737488355328"}, {"receive_count", "2"},
	}
	var b strings.Builder
	b.WriteByte('{')
	for _, f := range fields {
		v, changed := change[f.k]
		if !changed {
			v = f.v
		}
		if v == "" {
			continue
		}
		if b.Len() > 1 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, "%q:%s", f.k, v)
	}
	b.WriteByte('}')
	return b.String()
}

// Follow-ups the encoder would fail on (a KeyError on a field it indexes,
// which reads as an encoder fault, and for /send releases the whole request
// for every sibling rank, §4) or could not act on are answered 400 by the
// gateway in the encoder's envelope, naming the field, and never forwarded:
// no encoder sees any of them, no breaker counts anything, no pin is made.
func TestMalformedFollowUpsAreRefusedBeforeForwarding(t *testing.T) {
	// Short waits on both sides only make a regression (a forwarded call
	// the fake would hold) fail fast; nothing here should wait at all.
	encs := startFakes(t, 2, func(_ int, o *fakeencoder.Options) {
		o.MetadataTimeout, o.RegisterTimeout = 100*time.Millisecond, 100*time.Millisecond
	})
	g := startGateway(t, fakeURLs(encs), func(c *Config) {
		c.Health.Disabled = true
		c.Affinity.UnknownWait = 0
		c.Retry.Metadata.MaxAttempts, c.Retry.ReceiveURL.MaxAttempts = 1, 1
	})
	const (
		meta     = "/scheduler_receive_meta_data"
		register = "/scheduler_receive_url"
		send     = "/send"
	)
	const notObject = "must be a JSON object"
	tests := []struct {
		name, path, body string
		reqID            *string // the envelope's req_id; nil: null
		names            string  // what the message must name
	}{
		{"no part_idx", meta, `{"req_id":"mal-m1"}`, strp("mal-m1"), "part_idx"},
		{"string part_idx", meta, `{"req_id":"mal-m2","part_idx":"0"}`, strp("mal-m2"), "part_idx"},
		{"negative part_idx", meta, `{"req_id":"mal-m3","part_idx":-1}`, strp("mal-m3"), "part_idx"},
		{"fractional part_idx", meta, `{"req_id":"mal-m4","part_idx":0.5}`, strp("mal-m4"), "part_idx"},
		{"null part_idx", meta, `{"req_id":"mal-m5","part_idx":null}`, strp("mal-m5"), "part_idx"},
		{"no req_id", meta, `{"part_idx":0}`, nil, "req_id"},
		{"array body", meta, `[{"req_id":"mal-m7","part_idx":0}]`, nil, notObject},

		{"no receive_url", register, `{"req_id":"mal-r1","receive_count":2}`, strp("mal-r1"), "receive_url"},
		{"empty receive_url", register, `{"req_id":"mal-r2","receive_count":2,"receive_url":""}`, strp("mal-r2"), "receive_url"},
		{"numeric receive_url", register, `{"req_id":"mal-r3","receive_count":2,"receive_url":5000}`, strp("mal-r3"), "receive_url"},
		{"no receive_count", register, `{"req_id":"mal-r4","receive_url":"10.0.0.1:5000"}`, strp("mal-r4"), "receive_count"},
		{"zero receive_count", register, registerBody("mal-r5", "10.0.0.1:5000", 0), strp("mal-r5"), "receive_count"},
		{"string receive_count", register, `{"req_id":"mal-r6","receive_count":"2","receive_url":"10.0.0.1:5000"}`, strp("mal-r6"), "receive_count"},
		{"negative receive_count", register, registerBody("mal-r7", "10.0.0.1:5000", -1), strp("mal-r7"), "receive_count"},
		{"fractional receive_count", register, `{"req_id":"mal-r8","receive_count":1.5,"receive_url":"10.0.0.1:5000"}`, strp("mal-r8"), "receive_count"},
		{"no req_id", register, `{"receive_count":2,"receive_url":"10.0.0.1:5000"}`, nil, "req_id"},
		{"string body", register, `"mal-r10"`, nil, notObject},

		{"no prefill_host", send, sendWith("mal-s1", map[string]string{"prefill_host": ""}), strp("mal-s1"), "prefill_host"},
		{"empty prefill_host", send, sendWith("mal-s2", map[string]string{"prefill_host": `""`}), strp("mal-s2"), "prefill_host"},
		{"no embedding_port", send, sendWith("mal-s3", map[string]string{"embedding_port": ""}), strp("mal-s3"), "embedding_port"},
		{"embedding_port 0", send, sendWith("mal-s4", map[string]string{"embedding_port": "0"}), strp("mal-s4"), "embedding_port"},
		{"embedding_port 70000", send, sendWith("mal-s5", map[string]string{"embedding_port": "70000"}), strp("mal-s5"), "embedding_port"},
		{"string embedding_port", send, sendWith("mal-s6", map[string]string{"embedding_port": `"40000"`}), strp("mal-s6"), "embedding_port"},
		{"no session_id", send, sendWith("mal-s7", map[string]string{"session_id": ""}), strp("mal-s7"), "session_id"},
		{"empty session_id", send, sendWith("mal-s8", map[string]string{"session_id": `""`}), strp("mal-s8"), "session_id"},
		{"no buffer_address", send, sendWith("mal-s9", map[string]string{"buffer_address": ""}), strp("mal-s9"), "buffer_address"},
		{"buffer_address 1.5", send, sendWith("mal-s10", map[string]string{"buffer_address": "1.5"}), strp("mal-s10"), "buffer_address"},
		{"buffer_address -1", send, sendWith("mal-s11", map[string]string{"buffer_address": "-1"}), strp("mal-s11"), "buffer_address"},
		{"string buffer_address", send, sendWith("mal-s12", map[string]string{"buffer_address": `"1"`}), strp("mal-s12"), "buffer_address"},
		{"negative receive_count", send, sendWith("mal-s13", map[string]string{"receive_count": "-1"}), strp("mal-s13"), "receive_count"},
		{"no req_id", send, sendWith("", map[string]string{"req_id": ""}), nil, "req_id"},
		{"number body", send, `42`, nil, notObject},
		{"null body", send, `null`, nil, notObject},
	}
	if len(tests) < 30 {
		t.Fatalf("only %d cases", len(tests))
	}
	for _, tc := range tests {
		t.Run(tc.path+"/"+tc.name, func(t *testing.T) {
			msg := wantEnvelope(t, post(t, g.base+tc.path, tc.body), http.StatusBadRequest, tc.reqID)
			if !strings.Contains(msg, tc.names) {
				t.Fatalf("message %q does not name %q", msg, tc.names)
			}
		})
	}
	if seen := routesSeen(encs); len(seen) != 0 {
		t.Fatalf("malformed follow-ups reached the encoders: %v", seen)
	}
	for _, e := range g.Pool().Encoders() {
		if st, c := e.Breaker.State(), e.Breaker.Counts(); st != upstream.BreakerClosed || c != (upstream.BreakerCounts{}) {
			t.Errorf("%s: breaker %v with counts %+v, want closed and nothing counted", e.Name, st, c)
		}
		if n := e.Requests(); n != 0 {
			t.Errorf("%s: the gateway started %d exchanges with it", e.Name, n)
		}
	}
	if n := seriesValue(t, g, "encgate_breaker_outcomes_total"); n != 0 {
		t.Errorf("encgate_breaker_outcomes_total = %v, want 0", n)
	}
	if n := g.Pool().PinsHeld(); n != 0 {
		t.Errorf("malformed follow-ups left %d pins", n)
	}
}

// GEN0 mooncake with a receiver of TP 6: every rank posts the part's
// /encode itself and the encoder dedupes them (§11). When the first one
// fails with a 400 about the request's media, the five siblings get GEN0's
// "500 Encode failed on the first request": a consequence of another
// request's failure, not of the encoder's health. All six go to the one
// encoder that holds the part; its breaker stays closed with no failure and
// it keeps getting the encodes it owns.
func TestGen0FailedPartWithTP6LeavesTheBreakerClosed(t *testing.T) {
	h := newHeldEncodes(t, func(id string) bool { return strings.HasPrefix(id, "tp6-") })
	encs := startFakes(t, 2, func(_ int, o *fakeencoder.Options) {
		o.Generation = fakeencoder.Gen0
		o.EncodeHook = h.hook
	})
	g := startGateway(t, fakeURLs(encs), func(c *Config) {
		allGen0(c)
		c.Health.Disabled = true
		c.Breaker.ConsecutiveFailures = 3
	})
	cs := newCallers(t)
	owner, other := encs[1], encs[0]
	enc := g.Pool().Encoders()[1]
	id := ownedBy(t, g, enc.Name, "tp6")
	const msg = "Error while loading data https://x/missing.png: 404"
	const tp = 6
	var ranks []<-chan result
	for rank := 0; rank < tp; rank++ {
		ranks = append(ranks, cs.post(g.base+"/encode", gen0RankBody(id, 40000+rank, tp, "fail-encode:400:"+msg)))
	}
	if got := h.waitEntered(t); got != id {
		t.Fatalf("the hook holds %q, want %q", got, id)
	}
	// An answer before that is wrong; it is reported below.
	eventually(t, "the five sibling ranks to wait for the first /encode", func() bool {
		return answeredEarly(ranks) || owner.Stats().Waiting["/encode"] == tp-1
	})
	h.release()
	var failed, siblings int
	for rank, ch := range ranks {
		a := await(t, fmt.Sprintf("rank %d", rank), ch)
		if got := a.header.Get("X-Encgate-Encoder"); got != enc.Name {
			t.Errorf("rank %d answered by %q, want %s", rank, got, enc.Name)
		}
		switch a.status {
		case http.StatusBadRequest:
			failed++
			wantEnvelopeMsg(t, a, http.StatusBadRequest, msg, &id)
		case http.StatusInternalServerError:
			siblings++
			wantEnvelopeMsg(t, a, http.StatusInternalServerError, fakeencoder.Gen0DuplicateFailed, &id)
		default:
			t.Fatalf("rank %d: %d %s", rank, a.status, a.body)
		}
	}
	if failed != 1 || siblings != tp-1 {
		t.Fatalf("%d ranks got the 400 and %d the sibling 500, want 1 and %d", failed, siblings, tp-1)
	}
	if n := owner.Stats().ReqIDs[id]["/encode"]; n != tp {
		t.Fatalf("%s received %d of the part's /encodes, want all %d", enc.Name, n, tp)
	}
	if seen := other.Stats().ReqIDs[id]; seen != nil {
		t.Fatalf("the other encoder received %v for the part", seen)
	}
	// The part's failure is remembered as the first rank's, not the siblings'.
	if pin, _ := g.Pool().Pin(id); !pin.Failed() || pin.Status != http.StatusBadRequest || pin.Message != msg {
		t.Errorf("pin %+v, want the 400 %q", pin, msg)
	}
	breakerNoFault(t, g, enc)
	for i := 0; i < 10; i++ {
		good := ownedBy(t, g, enc.Name, fmt.Sprintf("tp6good%d", i))
		a := post(t, g.base+"/encode", gen0RankBody(good, 41000, 1, "https://example.com/a.png"))
		if a.status != 200 || a.header.Get("X-Encgate-Encoder") != enc.Name {
			t.Fatalf("good /encode %s: %d from %q, want 200 from %s: %s", good, a.status, a.header.Get("X-Encgate-Encoder"), enc.Name, a.body)
		}
		sizesOf(t, a)
	}
	breakerNoFault(t, g, enc)
}

// NEW: a part's six receiver ranks pull its metadata while its /encode
// fails on bad media. The encoder answers each waiting pull 500 with the
// encode's error (§5: the failure published as metadata). That is the
// /encode's failure seen six more times, judged once on the /encode
// itself: the breaker stays closed, and with a 400 nothing counts at all.
// The same with a CUDA fault: the one /encode counts, its six pulls do not.
func TestNewFailedPartsPullsLeaveTheBreakerClosed(t *testing.T) {
	for _, tc := range []struct {
		name, hook string
		status     int
		faults     float64 // what the breaker counts
	}{
		{"bad media", "fail:400:Error while loading data https://x/missing.png: 404", 400, 0},
		{"cuda fault", "fail:500:Internal encoding error: CUDA out of memory", 500, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			encs := startFakes(t, 1, nil)
			g := startGateway(t, fakeURLs(encs), func(c *Config) {
				c.Health.Disabled = true
				c.Breaker.ConsecutiveFailures = 3
				c.Affinity.UnknownWait = 0   // the pulls go to the owner and wait there
				c.Affinity.MetadataCache = 0 // six pulls at the encoder, not one shared
			})
			cs := newCallers(t)
			const id = "tp6new_local_part_0"
			const tp = 6
			var pulls []<-chan result
			for rank := 0; rank < tp; rank++ {
				pulls = append(pulls, cs.post(g.base+"/scheduler_receive_meta_data", metaBody(id)))
			}
			eventually(t, "the six pulls to wait at the encoder", func() bool {
				return answeredEarly(pulls) || encs[0].Stats().Waiting["/scheduler_receive_meta_data"] == tp
			})
			msg := tc.hook[len("fail:000:"):]
			wantEnvelopeMsg(t, post(t, g.base+"/encode", tokenizerEncode(id, tc.hook)), tc.status, msg, strp(id))
			for rank, ch := range pulls {
				wantEnvelopeMsg(t, await(t, fmt.Sprintf("pull %d", rank), ch), http.StatusInternalServerError, msg, strp(id))
			}
			e := g.Pool().Encoders()[0]
			if st, c := e.Breaker.State(), e.Breaker.Counts(); st != upstream.BreakerClosed || float64(c.TotalFailures) != tc.faults {
				t.Fatalf("breaker %v, counts %+v; want closed with %v failures", st, c, tc.faults)
			}
			if n := seriesValue(t, g, "encgate_breaker_outcomes_total", "encoder", e.Name, "outcome", "fault"); n != tc.faults {
				t.Fatalf("faults counted %v, want %v", n, tc.faults)
			}
			if a := post(t, g.base+"/encode", encodeBody("after_local_part_0")); a.status != 200 {
				t.Fatalf("a good /encode after the failed part: %d %s", a.status, a.body)
			}
		})
	}
}

// A 500 the encoder raises about itself ("Internal encoding error: CUDA out
// of memory") is an instance fault: the breaker opens after
// breaker.consecutive_failures of them, and the /encodes that encoder owns
// then go to the next encoder.
func TestCudaOOMStillOpensTheBreaker(t *testing.T) {
	const oom = "Internal encoding error: CUDA out of memory"
	encs := startFakes(t, 2, func(i int, o *fakeencoder.Options) {
		if i == 0 {
			o.Faults.FailureRate, o.Faults.FailStatus = 1, 500
			o.Faults.FailMessage, o.Faults.FailRoutes = oom, []string{"/encode"}
		}
	})
	g := startGateway(t, fakeURLs(encs), func(c *Config) {
		c.Health.Disabled = true
		c.Breaker.ConsecutiveFailures = 3
	})
	bad := g.Pool().Encoders()[0]
	var ids []string // owned by enc-0 while its breaker is closed
	for i := 0; i < 6; i++ {
		ids = append(ids, ownedBy(t, g, bad.Name, fmt.Sprintf("oom%d", i)))
	}
	for _, id := range ids[:3] {
		a := post(t, g.base+"/encode", encodeBody(id))
		wantEnvelopeMsg(t, a, http.StatusInternalServerError, oom, &id)
		if got := a.header.Get("X-Encgate-Encoder"); got != bad.Name {
			t.Fatalf("%s answered by %q", id, got)
		}
	}
	if st := bad.Breaker.State(); st != upstream.BreakerOpen {
		t.Fatalf("after 3 CUDA faults the breaker is %v, want open", st)
	}
	for _, id := range ids[3:] {
		a := post(t, g.base+"/encode", encodeBody(id))
		if a.status != 200 || a.header.Get("X-Encgate-Encoder") != "enc-1" {
			t.Fatalf("%s after the breaker opened: %d from %q, want 200 from enc-1: %s", id, a.status, a.header.Get("X-Encgate-Encoder"), a.body)
		}
	}
	if n := encs[0].Stats().Routes["/encode"]; n != 3 {
		t.Fatalf("the faulty encoder received %d /encodes, want 3", n)
	}
	if n := seriesValue(t, g, "encgate_breaker_outcomes_total", "encoder", bad.Name, "outcome", "fault"); n != 3 {
		t.Fatalf(`encgate_breaker_outcomes_total{encoder="enc-0",outcome="fault"} = %v, want 3`, n)
	}
	if n := seriesValue(t, g, "encgate_breaker_outcomes_total", "encoder", "enc-1", "outcome", "fault"); n != 0 {
		t.Fatalf(`encgate_breaker_outcomes_total{encoder="enc-1",outcome="fault"} = %v, want 0`, n)
	}
}

// zmqRanks starts n acktest sinks, the receiver ranks' PULL sockets.
func zmqRanks(t *testing.T, n int) []*acktest.Sink {
	t.Helper()
	var sinks []*acktest.Sink
	for i := 0; i < n; i++ {
		s, err := acktest.Start(acktest.Options{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = s.Close() })
		sinks = append(sinks, s)
	}
	return sinks
}

func sinkURL(s *acktest.Sink) string { return "127.0.0.1:" + strconv.Itoa(s.Port()) }

// zmqFrame is the fake's JSON stand-in for frame 0 of a pushed message.
type zmqFrame struct {
	ReqID     string  `json:"req_id"`
	ErrorMsg  *string `json:"error_msg"`
	ErrorCode *int    `json:"error_code"`
}

// wantErrorFrames waits until the fake pushed its error frame to every
// sink, then checks that each sink got exactly that one one-frame message,
// carrying the encode's message and status.
func wantErrorFrames(t *testing.T, fake *fakeencoder.Encoder, sinks []*acktest.Sink, id, msg string, code int) {
	t.Helper()
	for i, s := range sinks {
		select {
		case <-s.Messages():
		case <-time.After(10 * time.Second):
			t.Fatalf("rank %d's socket got no message within 10s; pushes %v, failures %v",
				i, fake.Stats().Pushes, fake.Stats().PushFailures)
		}
	}
	// A push is listed once the rank's socket read it and closed.
	eventually(t, "every push to be recorded", func() bool { return len(fake.Stats().Pushes) == len(sinks) })
	st := fake.Stats()
	for i, s := range sinks {
		if got := st.Pushes[id+"|"+sinkURL(s)]; len(got) != 1 || got[0] != fakeencoder.PushError {
			t.Errorf("rank %d: pushes %v, want one %q", i, got, fakeencoder.PushError)
		}
		msgs := s.Frames()
		if len(msgs) != 1 || len(msgs[0]) != 1 {
			t.Errorf("rank %d received %d messages (%v), want one one-frame message", i, len(msgs), msgs)
			continue
		}
		if !strings.Contains(string(msgs[0][0]), msg) {
			t.Errorf("rank %d's frame %s does not carry %q", i, msgs[0][0], msg)
		}
		var f zmqFrame
		if err := json.Unmarshal(msgs[0][0], &f); err != nil || f.ReqID != id || f.ErrorMsg == nil || *f.ErrorMsg != msg ||
			f.ErrorCode == nil || *f.ErrorCode != code {
			t.Errorf("rank %d's frame %s: want req_id %q, error_msg %q, error_code %d (%v)", i, msgs[0][0], id, msg, code, err)
		}
	}
	if st.PushFailures != nil {
		t.Errorf("failed pushes: %v", st.PushFailures)
	}
}

// GEN0 zmq_to_scheduler reports a failed /encode to the receiver ranks only
// through its own error frame, pushed to the URLs registered with it
// (§11): a rank whose registration never reaches the encoder waits 180s
// and aborts with 408. So after the tokenizer's /encode failed, the gateway
// forwards each rank's registration (it is idempotent) instead of answering
// it from the remembered failure, the encoder answers it, and every rank's
// socket gets exactly one error frame with the encoder's message. The same
// holds for registrations that came before the /encode failed: they wait
// for the pin and are forwarded while it is pending.
func TestGen0ZmqRegistrationsAfterAFailedEncodeReachTheEncoder(t *testing.T) {
	const msg = "Error while loading data https://x/missing.png: 404"
	const tp = 6
	setup := func(t *testing.T) (*gw, *callers, *fakeencoder.Encoder, []*acktest.Sink, *heldEncodes) {
		sinks := zmqRanks(t, tp) // closed after the fake
		h := newHeldEncodes(t, func(id string) bool { return strings.HasPrefix(id, "held-") })
		encs := startFakes(t, 1, func(_ int, o *fakeencoder.Options) {
			o.Mode, o.Generation, o.PushFrames = fakeencoder.ModeZMQ, fakeencoder.Gen0, true
			o.EncodeHook = h.hook
		})
		g := startGateway(t, fakeURLs(encs), func(c *Config) {
			allGen0(c)
			c.Health.Disabled = true
		})
		return g, newCallers(t), encs[0], sinks, h
	}
	register := func(g *gw, cs *callers, id string, sinks []*acktest.Sink) []<-chan result {
		var out []<-chan result
		for _, s := range sinks {
			out = append(out, cs.post(g.base+"/scheduler_receive_url", registerBody(id, sinkURL(s), tp)))
		}
		return out
	}
	wantForwarded := func(t *testing.T, fake *fakeencoder.Encoder, id string, sinks []*acktest.Sink, regs []<-chan result) {
		t.Helper()
		for rank, ch := range regs {
			a := await(t, fmt.Sprintf("rank %d's registration", rank), ch)
			if a.status != 200 || a.body != "null" || a.header.Get("X-Encgate-Encoder") != "enc-0" {
				t.Fatalf("rank %d's registration: %d %q from %q, want the encoder's 200 null", rank, a.status, a.body, a.header.Get("X-Encgate-Encoder"))
			}
		}
		regsSeen := fake.Stats().Registrations
		for rank, s := range sinks {
			if n := regsSeen[id+"|"+sinkURL(s)]; n != 1 {
				t.Errorf("rank %d's registration reached the encoder %d times, want once (all: %v)", rank, n, regsSeen)
			}
		}
	}

	t.Run("after the failure", func(t *testing.T) {
		g, cs, fake, sinks, _ := setup(t)
		const id = "late_local_part_0"
		a := post(t, g.base+"/encode", tokenizerEncode(id, "fail:400:"+msg))
		wantEnvelopeMsg(t, a, http.StatusBadRequest, msg, strp(id))
		if pin, _ := g.Pool().Pin(id); !pin.Failed() || !pin.Answered {
			t.Fatalf("pin %+v, want the encoder's own failure", pin)
		}
		wantForwarded(t, fake, id, sinks, register(g, cs, id, sinks))
		wantErrorFrames(t, fake, sinks, id, msg, http.StatusBadRequest)
	})

	t.Run("before the failure", func(t *testing.T) {
		g, cs, fake, sinks, h := setup(t)
		const id = "held-early_local_part_0"
		regs := register(g, cs, id, sinks)
		eventually(t, "the registrations to wait for the pin", func() bool { return g.Pool().PinWaiters() == 1 })
		enc := cs.post(g.base+"/encode", tokenizerEncode(id, "fail-encode:400:"+msg))
		if got := h.waitEntered(t); got != id {
			t.Fatalf("the hook holds %q", got)
		}
		// The /encode is held, its pin pending: the registrations go on.
		wantForwarded(t, fake, id, sinks, regs)
		if pin, _ := g.Pool().Pin(id); pin.State != upstream.PinPending {
			t.Fatalf("pin %+v while the /encode is held, want pending", pin)
		}
		if n := len(fake.Stats().Pushes); n != 0 {
			t.Fatalf("%d pushes before the encode finished", n)
		}
		h.release()
		wantEnvelopeMsg(t, await(t, "the /encode", enc), http.StatusBadRequest, msg, strp(id))
		wantErrorFrames(t, fake, sinks, id, msg, http.StatusBadRequest)
	})
}

// An encoder that holds a registration for a failed part instead of
// pushing an error frame (as issue 27 saw NEW-layout encoders do), with no
// generation key: the gateway does not know it yet, so it forwards the six
// registrations of the first failed part, bounded by
// affinity.failed_registration_wait; past the bound each rank gets the
// remembered failure (the /encode's status and message) and the gateway
// learns. The six registrations of the next failed part are answered at
// once, and none of them reaches the encoder.
func TestHeldZmqRegistrationsAfterAFailedEncodeAreAnsweredFromTheFailure(t *testing.T) {
	const msg = "Error while loading data https://x/missing.png: 404"
	const tp = 6
	sinks := zmqRanks(t, tp)
	encs := startFakes(t, 1, func(_ int, o *fakeencoder.Options) {
		o.Mode, o.PushFrames, o.HoldFailedRegistrations = fakeencoder.ModeZMQ, true, true
	})
	g := startGateway(t, fakeURLs(encs), func(c *Config) {
		c.Health.Disabled = true
		c.Affinity.FailedRegistrationWait = configfile.Duration(200 * time.Millisecond)
	})
	cs := newCallers(t)
	e, _ := g.Pool().Lookup("enc-0")
	if got := e.Learned().TakesFailedRegistration; got != upstream.Unknown {
		t.Fatalf("before any failure: takes_failed_registration %s", got)
	}
	part := func(id string, wantSent bool) {
		t.Helper()
		wantEnvelopeMsg(t, post(t, g.base+"/encode", tokenizerEncode(id, "fail:400:"+msg)), http.StatusBadRequest, msg, strp(id))
		var regs []<-chan result
		for _, s := range sinks {
			regs = append(regs, cs.post(g.base+"/scheduler_receive_url", registerBody(id, sinkURL(s), tp)))
		}
		for rank, ch := range regs {
			a := await(t, fmt.Sprintf("%s: rank %d's registration", id, rank), ch)
			wantEnvelopeMsg(t, a, http.StatusBadRequest, msg, strp(id))
			if got := a.header.Get("X-Encgate-Encoder"); got != "enc-0" {
				t.Errorf("rank %d: X-Encgate-Encoder %q, want the failed /encode's enc-0", rank, got)
			}
			if sent := a.header.Get("X-Encgate-Attempts") != ""; sent != wantSent {
				t.Errorf("%s: rank %d's registration sent %v, want %v", id, rank, sent, wantSent)
			}
		}
		if n := encs[0].Stats().ReqIDs[id]["/scheduler_receive_url"]; wantSent != (n == tp) || !wantSent && n != 0 {
			t.Errorf("%s: the encoder received %d registrations, sent %v", id, n, wantSent)
		}
	}
	part("held-1_local_part_0", true)
	if l := e.Learned(); l.TakesFailedRegistration != upstream.No || l.Guess != "new" {
		t.Fatalf("learned %+v, want takes_failed_registration no (new)", l)
	}
	part("held-2_local_part_0", false)
	st := encs[0].Stats()
	if len(st.Pushes) != 0 {
		t.Fatalf("pushes %v", st.Pushes)
	}
	for rank, s := range sinks {
		if n := len(s.Frames()); n != 0 {
			t.Errorf("rank %d received %d messages", rank, n)
		}
	}
}

// GEN0 mooncake: rank 1's /encode of a part is on enc-0 (held in the encode
// hook) when enc-0's breaker opens on three CUDA faults of other parts.
// Ranks 2-6 then post the same part's /encode: they are not new work but
// the part already placed there, which only enc-0 can answer, so they
// follow the pin through the open breaker instead of being placed on enc-1;
// the encoder dedupes them onto rank 1's encode and all six get its sizes.
func TestSixRanksEncodeReachOneEncoderThoughItsBreakerOpens(t *testing.T) {
	h := newHeldEncodes(t, func(id string) bool { return strings.HasPrefix(id, "six-") })
	encs := startFakes(t, 2, func(_ int, o *fakeencoder.Options) {
		o.Generation = fakeencoder.Gen0
		o.EncodeHook = h.hook
	})
	g := startGateway(t, fakeURLs(encs), func(c *Config) {
		allGen0(c)
		c.Health.Disabled = true
		c.Breaker.ConsecutiveFailures = 3
	})
	cs := newCallers(t)
	enc0 := g.Pool().Encoders()[0]
	id := ownedBy(t, g, enc0.Name, "six")
	var ooms []string
	for i := 0; i < 3; i++ {
		ooms = append(ooms, ownedBy(t, g, enc0.Name, fmt.Sprintf("oom%d", i)))
	}
	const tp = 6
	first := cs.post(g.base+"/encode", gen0RankBody(id, 40000, tp, "https://example.com/a.png"))
	if got := h.waitEntered(t); got != id {
		t.Fatalf("the hook holds %q", got)
	}
	const oom = "Internal encoding error: CUDA out of memory"
	for _, o := range ooms {
		a := post(t, g.base+"/encode", gen0RankBody(o, 40000, 1, "fail-encode:500:"+oom))
		wantEnvelopeMsg(t, a, http.StatusInternalServerError, oom, &o)
	}
	if st := enc0.Breaker.State(); st != upstream.BreakerOpen {
		t.Fatalf("enc-0's breaker is %v after three CUDA faults, want open", st)
	}
	ranks := []<-chan result{first}
	for rank := 1; rank < tp; rank++ {
		ranks = append(ranks, cs.post(g.base+"/encode", gen0RankBody(id, 40000+rank, tp, "https://example.com/a.png")))
	}
	// An answer before that is wrong (a 503 from the gateway, say); it is
	// reported below.
	eventually(t, "ranks 2-6 to wait at enc-0 for rank 1's encode", func() bool {
		return answeredEarly(ranks[1:]) || encs[0].Stats().Waiting["/encode"] == tp-1
	})
	h.release()
	var want embeddingSizes
	for rank, ch := range ranks {
		a := await(t, fmt.Sprintf("rank %d", rank+1), ch)
		if a.status != 200 || a.header.Get("X-Encgate-Encoder") != enc0.Name {
			t.Fatalf("rank %d: %d from %q, want 200 from enc-0: %s", rank+1, a.status, a.header.Get("X-Encgate-Encoder"), a.body)
		}
		s := sizesOf(t, a)
		if rank == 0 {
			want = s
		} else if s != want {
			t.Errorf("rank %d got sizes %+v, rank 1 %+v", rank+1, s, want)
		}
	}
	if seen := encs[1].Stats().ReqIDs[id]; seen != nil {
		t.Fatalf("enc-1 received %v for the part", seen)
	}
	if n := encs[0].Stats().ReqIDs[id]["/encode"]; n != tp {
		t.Fatalf("enc-0 received %d of the part's /encodes, want %d", n, tp)
	}
	if pin, _ := g.Pool().Pin(id); pin.State != upstream.PinEncoded || pin.Encoder != enc0.Name {
		t.Errorf("pin %+v, want encoded on enc-0", pin)
	}
}

// A req_id whose /encode was answered 200 keeps its pin when a later
// /encode of the same req_id fails, whether the gateway refuses that one
// itself or the encoder answers it 400: the encoder still holds the part,
// so its follow-ups are forwarded to it, not answered from a remembered
// failure.
func TestAGoodPinSurvivesALaterBadEncode(t *testing.T) {
	t.Run("refused by the gateway", func(t *testing.T) {
		encs := startFakes(t, 1, nil)
		g := startGateway(t, fakeURLs(encs), func(c *Config) { c.Health.Disabled = true })
		const id = "good-then-refused_local_part_0"
		enc := post(t, g.base+"/encode", encodeBody(id))
		if enc.status != 200 {
			t.Fatalf("/encode: %d %s", enc.status, enc.body)
		}
		bad := strings.Replace(encodeBody(id), `"num_parts":1`, `"num_parts":0`, 1)
		wantEnvelopeMsg(t, post(t, g.base+"/encode", bad), http.StatusBadRequest, "num_parts must be a positive integer", strp(id))
		if pin, _ := g.Pool().Pin(id); pin.State != upstream.PinEncoded {
			t.Fatalf("pin %+v after the refused /encode, want still encoded", pin)
		}
		meta := post(t, g.base+routeMetadata, metaBody(id))
		if meta.status != 200 || sizesOf(t, meta) != sizesOf(t, enc) {
			t.Fatalf("metadata pull: %d %s, want the encode's sizes (%s)", meta.status, meta.body, enc.body)
		}
		if a := post(t, g.base+"/send", tpSend(id, 0, 1)); a.status != 200 || a.body != "null" {
			t.Fatalf("/send: %d %s", a.status, a.body)
		}
		seen := encs[0].Stats().ReqIDs[id]
		if seen["/encode"] != 1 || seen[routeMetadata] != 1 || seen["/send"] != 1 {
			t.Fatalf("the encoder received %v, want the good /encode and both follow-ups", seen)
		}
	})

	t.Run("answered 400 by the encoder", func(t *testing.T) {
		s := newScripted(t)
		g := startGateway(t, []string{s.URL}, func(c *Config) { c.Health.Disabled = true })
		const id = "good-then-400_local_part_0"
		if a := post(t, g.base+"/encode", encodeBody(id)); a.status != 200 || a.body != "null" {
			t.Fatalf("first /encode: %d %s", a.status, a.body)
		}
		const msg = "Error while loading data https://example.com/a.png: 404"
		s.answer("/encode", scriptedAnswer{400, ct("application/json"),
			`{"status":"error","message":"` + msg + `","req_id":"` + id + `"}`})
		wantEnvelopeMsg(t, post(t, g.base+"/encode", encodeBody(id)), http.StatusBadRequest, msg, strp(id))
		if pin, _ := g.Pool().Pin(id); pin.State != upstream.PinEncoded {
			t.Fatalf("pin %+v after the encoder's 400, want still encoded", pin)
		}
		const sizes = `{"req_id":"` + id + `","part_idx":0,"embedding_size":524288,"embedding_len":256,"embedding_dim":1024}`
		s.answer(routeMetadata, scriptedAnswer{200, ct("application/json"), sizes})
		meta := post(t, g.base+routeMetadata, metaBody(id))
		if meta.status != 200 || meta.body != sizes {
			t.Fatalf("metadata pull: %d %s, want the encoder's %s", meta.status, meta.body, sizes)
		}
		if got := s.received(routeMetadata); len(got) != 1 || got[0] != metaBody(id) {
			t.Fatalf("the encoder received metadata pulls %q, want the one", got)
		}
		if reg := post(t, g.base+"/scheduler_receive_url", registerBody(id, "10.0.0.1:5000", 1)); reg.status != 200 || reg.body != "null" {
			t.Fatalf("registration: %d %s", reg.status, reg.body)
		}
		if n := len(s.received("/scheduler_receive_url")); n != 1 {
			t.Fatalf("the encoder received %d registrations, want 1", n)
		}
		if n := len(s.received("/encode")); n != 2 {
			t.Fatalf("the encoder received %d /encodes, want both", n)
		}
	})
}

// Issue 27, must-show "mixed fleet": one encoder of each sglang generation
// behind one gateway, zmq_to_scheduler, no generation key. A failed
// /encode is placed on each; its TP=2 ranks then register. GEN0 and GEN1
// take such a registration and push their own error frame (§11, §12): the
// gateway forwards it, and each rank hears the encoder's message and
// status in that frame. The NEW-style encoder holds it: the gateway cuts
// it off at affinity.failed_registration_wait and answers the ranks with
// the /encode's own status and message, never leaving them to a 180 s
// timeout. /admin/upstreams then shows what was learned of each.
func TestMixedFleetFailedZmqEncodesReachEveryRank(t *testing.T) {
	const tp = 2
	gens := []fakeencoder.Generation{fakeencoder.Gen0, fakeencoder.Gen1, fakeencoder.GenNew}
	encs := startFakes(t, len(gens), func(i int, o *fakeencoder.Options) {
		o.Mode, o.PushFrames, o.Generation = fakeencoder.ModeZMQ, true, gens[i]
		o.HoldFailedRegistrations = gens[i] == fakeencoder.GenNew
	})
	g := startGateway(t, fakeURLs(encs), func(c *Config) {
		c.Health.Disabled = true
		c.Affinity.FailedRegistrationWait = configfile.Duration(300 * time.Millisecond)
	})
	cs := newCallers(t)
	done := map[string]bool{}
	for i := 0; len(done) < len(encs); i++ {
		if i > 200 {
			t.Fatalf("200 parts placed on %v only", done)
		}
		id := fmt.Sprintf("mixed-%d_local_part_0", i)
		msg := "Error while loading data https://x/" + id + ".png: 404"
		a := post(t, g.base+"/encode", tokenizerEncode(id, "fail:400:"+msg))
		name := a.header.Get("X-Encgate-Encoder")
		wantEnvelopeMsg(t, a, http.StatusBadRequest, msg, strp(id))
		if done[name] {
			continue // its send_with_url waits for registrations that never come; harmless
		}
		done[name] = true
		idx := int(name[len(name)-1] - '0')
		fake, gen := encs[idx], gens[idx]
		sinks := zmqRanks(t, tp)
		var regs []<-chan result
		for _, s := range sinks {
			regs = append(regs, cs.post(g.base+"/scheduler_receive_url", registerBody(id, sinkURL(s), tp)))
		}
		for rank, ch := range regs {
			a := await(t, fmt.Sprintf("%s rank %d's registration", gen, rank), ch)
			if gen == fakeencoder.GenNew {
				wantEnvelopeMsg(t, a, http.StatusBadRequest, msg, strp(id))
			} else if a.status != 200 || a.body != "null" {
				t.Fatalf("%s rank %d's registration: %d %s, want the encoder's 200 null", gen, rank, a.status, a.body)
			}
		}
		if gen != fakeencoder.GenNew {
			wantErrorFrames(t, fake, sinks, id, msg, http.StatusBadRequest)
		}
		e, _ := g.Pool().Lookup(name)
		want := map[bool]upstream.Fact{true: upstream.No, false: upstream.Yes}[gen == fakeencoder.GenNew]
		if l := e.Learned(); l.TakesFailedRegistration != want {
			t.Fatalf("%s (%s): learned %+v, want takes_failed_registration %s", name, gen, l, want)
		}
	}
	var rows []upstream.EncoderState
	if err := json.Unmarshal([]byte(do(t, http.MethodGet, g.admin+"/admin/upstreams", "").body), &rows); err != nil {
		t.Fatal(err)
	}
	for _, r := range rows {
		t.Logf("/admin/upstreams %s: learned %+v", r.Name, r.Learned)
		if r.Learned.TakesFailedRegistration == upstream.Unknown {
			t.Errorf("%s: nothing learned in /admin/upstreams: %+v", r.Name, r.Learned)
		}
	}

	// A rolling upgrade: the NEW-style encoder stops, and a GEN1 one comes
	// up at its URL. The first exchange that cannot reach it (a dial
	// failure) forgets what was learned; that /encode goes to the next
	// encoder, which answers it, so nothing is lost meanwhile. The newcomer's first failed
	// part then teaches afresh: its ranks' registrations are forwarded and
	// hear the GEN1 encoder's own frame.
	nw := slices.Index(gens, fakeencoder.GenNew)
	name := fmt.Sprintf("enc-%d", nw)
	addr := strings.TrimPrefix(encs[nw].URL(), "http://")
	encs[nw].Crash()
	e, _ := g.Pool().Lookup(name)
	for i := 0; e.Learned().Forgotten == 0; i++ {
		if i > 200 {
			t.Fatal("no /encode tried the stopped encoder")
		}
		id := fmt.Sprintf("down-%d_local_part_0", i)
		// zmq: a good /encode waits for its ranks' registrations, a failing
		// one is answered at once, by whichever encoder took it.
		if a := post(t, g.base+"/encode", tokenizerEncode(id, "fail:400:bad media")); a.status != 400 || a.header.Get("X-Encgate-Encoder") == name {
			t.Fatalf("/encode %s while %s is down: %d from %q %s", id, name, a.status, a.header.Get("X-Encgate-Encoder"), a.body)
		}
	}
	if l := e.Learned(); l.TakesFailedRegistration != upstream.Unknown {
		t.Fatalf("after the dial failure: learned %+v", l)
	}
	up := fakeencoder.New(fakeencoder.Options{Name: name, Mode: fakeencoder.ModeZMQ, PushFrames: true, Generation: fakeencoder.Gen1})
	if err := up.Start(addr); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = up.Close() })
	id := ownedBy(t, g, name, "upgraded")
	msg := "Error while loading data https://x/upgraded.png: 404"
	a := post(t, g.base+"/encode", tokenizerEncode(id, "fail:400:"+msg))
	wantEnvelopeMsg(t, a, http.StatusBadRequest, msg, strp(id))
	if got := a.header.Get("X-Encgate-Encoder"); got != name {
		t.Fatalf("the upgraded part went to %q", got)
	}
	sinks := zmqRanks(t, tp)
	for rank, s := range sinks {
		if a := post(t, g.base+"/scheduler_receive_url", registerBody(id, sinkURL(s), tp)); a.status != 200 || a.body != "null" {
			t.Fatalf("upgraded rank %d's registration: %d %s", rank, a.status, a.body)
		}
	}
	wantErrorFrames(t, up, sinks, id, msg, http.StatusBadRequest)
	if l := e.Learned(); l.TakesFailedRegistration != upstream.Yes || l.Forgotten != 1 {
		t.Fatalf("after the upgrade: learned %+v", l)
	}
}

// Issue 27, must-show "DP texts", against GEN1's DP mode (§12) over real
// sockets, no generation key. A metadata pull that comes before its
// /encode waits for the part's pin in the gateway (affinity.unknown_wait;
// the test sends the /encode once the pull is parked there, as a rank 4 s
// early would be) and ends 200. The DP encoder's own words for "not ready
// yet" are in the default metadata retry_on and never a breaker fault
// (TestDPNotReadyTextsAreRetriedNotFaults in upstream).
func TestGen1DPPullBeforeItsEncodeEnds200(t *testing.T) {
	encs := startFakes(t, 1, func(_ int, o *fakeencoder.Options) {
		o.Generation, o.DPSize, o.DPMappingWait = fakeencoder.Gen1, 2, 100*time.Millisecond
	})
	g := startGateway(t, fakeURLs(encs), func(c *Config) {
		c.Health.Disabled = true
		c.Affinity.UnknownWait = configfile.Duration(time.Second)
	})
	cs := newCallers(t)
	const id = "dp-early_local_part_0"
	pull := cs.post(g.base+"/scheduler_receive_meta_data", metaBody(id))
	eventually(t, "the pull to wait for the pin", func() bool { return g.Pool().PinWaiters() == 1 })
	if a := post(t, g.base+"/encode", encodeBody(id)); a.status != 200 {
		t.Fatalf("/encode: %d %s", a.status, a.body)
	}
	a := await(t, "the early pull", pull)
	if a.status != 200 || !strings.Contains(a.body, `"embedding_size":`) {
		t.Fatalf("the early pull: %d %s", a.status, a.body)
	}
	// Its /send: the DP fake answers with the encoder's null.
	for port := 40000; port < 40002; port++ {
		if a := post(t, g.base+"/send", sendBody(id, port)); a.status != 200 {
			t.Fatalf("/send %d: %d %s", port, a.status, a.body)
		}
	}
	e := g.Pool().Encoders()[0]
	if c := e.Breaker.Counts(); c.TotalFailures != 0 {
		t.Fatalf("breaker counts %+v", c)
	}
	// A pull for a part nobody encoded: the DP encoder's 404 after its
	// mapping wait passes through, teaches dp, and is no fault.
	a = post(t, g.base+"/scheduler_receive_meta_data", metaBody("nobody_local_part_0"))
	if a.status != 404 || !strings.Contains(a.body, "Unknown req_id") {
		t.Fatalf("pull of an unknown part: %d %s", a.status, a.body)
	}
	if l := e.Learned(); l.DP != upstream.Yes || l.ServesMetadata != upstream.Yes || l.Guess != "gen1" {
		t.Fatalf("learned %+v", l)
	}
	if c := e.Breaker.Counts(); c.TotalFailures != 0 {
		t.Fatalf("breaker counts %+v", c)
	}
}

// Issue 27, must-show "the race": GEN1's DP dispatcher drops a part's
// req_id → rank mapping when a sibling rank's metadata pull is answered
// while a /send of the part is in flight (§12, an sglang bug): that /send's
// result is discarded (504 after REQ_TIMEOUT) and the sibling's /send gets
// 500 Unknown req_id. The race-reproducing fake, TP=2, rank B skewed so
// that it pulls while rank A's /send is held in flight, 50 parts. Directly,
// every part breaks. Through the gateway, rank B's pull is answered from
// rank A's (affinity.metadata_cache) and never reaches the encoder, so
// both ranks' /sends succeed for every part.
func TestGen1DPMappingRaceCannotBeTriggeredThroughTheGateway(t *testing.T) {
	const parts = 50
	setup := func(t *testing.T) (*fakeencoder.Encoder, chan string, chan struct{}) {
		entered, release := make(chan string, 1), make(chan struct{})
		encs := startFakes(t, 1, func(_ int, o *fakeencoder.Options) {
			o.Generation, o.DPSize, o.DPMappingRace = fakeencoder.Gen1, 2, true
			o.MetadataTimeout = 100 * time.Millisecond // REQ_TIMEOUT: the discarded /send's 504 comes after it
			o.SendHook = func(ctx context.Context, id, dest string) {
				if !strings.HasSuffix(dest, ":40000") {
					return
				}
				entered <- id
				select {
				case <-release:
				case <-ctx.Done():
				}
			}
		})
		return encs[0], entered, release
	}
	run := func(t *testing.T, base string, entered chan string, release chan struct{}) (ok int, broken []string) {
		cs := newCallers(t)
		for i := range parts {
			id := fmt.Sprintf("race-%d_local_part_0", i)
			if a := post(t, base+"/encode", encodeBody(id)); a.status != 200 {
				t.Fatalf("%s /encode: %d %s", id, a.status, a.body)
			}
			if a := post(t, base+"/scheduler_receive_meta_data", metaBody(id)); a.status != 200 {
				t.Fatalf("%s rank A's pull: %d %s", id, a.status, a.body)
			}
			sendA := cs.post(base+"/send", sendBody(id, 40000))
			if got := <-entered; got != id {
				t.Fatalf("the hook holds %q", got)
			}
			pullB := post(t, base+"/scheduler_receive_meta_data", metaBody(id)) // skewed: while A's /send is in flight
			release <- struct{}{}
			a := await(t, id+" rank A's /send", sendA)
			b := post(t, base+"/send", sendBody(id, 40001))
			if pullB.status == 200 && a.status == 200 && b.status == 200 {
				ok++
			} else {
				broken = append(broken, fmt.Sprintf("%s: pull B %d, /send A %d %q, /send B %d %q", id, pullB.status, a.status, a.body, b.status, b.body))
			}
		}
		return ok, broken
	}
	t.Run("direct", func(t *testing.T) {
		fake, entered, release := setup(t)
		ok, broken := run(t, fake.URL(), entered, release)
		if ok != 0 {
			t.Errorf("%d of %d parts survived the race directly, want none", ok, parts)
		}
		if len(broken) > 0 {
			t.Logf("directly: %d of %d parts broken, e.g. %s", len(broken), parts, broken[0])
		}
	})
	t.Run("through the gateway", func(t *testing.T) {
		fake, entered, release := setup(t)
		g := startGateway(t, []string{fake.URL()}, func(c *Config) { c.Health.Disabled = true })
		ok, broken := run(t, g.base, entered, release)
		if ok != parts {
			t.Errorf("through the gateway %d of %d parts succeeded; %d broken, the first: %s", ok, parts, len(broken), broken[0])
		}
		st := fake.Stats()
		t.Logf("through the gateway: %d of %d parts, both ranks ok; the encoder saw %d metadata pulls for %d parts",
			ok, parts, st.Routes["/scheduler_receive_meta_data"], parts)
		e := g.Pool().Encoders()[0]
		if c := e.Breaker.Counts(); c.TotalFailures != 0 {
			t.Errorf("breaker counts %+v", c)
		}
	})
}
