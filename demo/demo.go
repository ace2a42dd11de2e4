// Package demo runs encgate's embedded default: a local fleet of fake sglang
// encoders behind one gateway, driven by an sglang-like workload, with a
// readable summary. It is what `encgate demo` runs.
package demo

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/encgate/encgate/fakeencoder"
	"github.com/encgate/encgate/gateway"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/jsonfield"
	"github.com/encgate/encgate/upstream"
)

// Options shape the workload. Zero values take the defaults shown.
type Options struct {
	Encoders    int  // fake encoders (default 3)
	Requests    int  // user requests (default 40)
	Parts       int  // parts per request, as sglang splits media across --encoder-urls (default 3)
	ReceiverTP  int  // receiver TP ranks, each calling metadata and /send (default 2)
	Concurrency int  // requests in flight (default 8)
	FailEvery   int  // every Nth request's part 0 has media that fails to load (default 10; <0 none)
	DupEvery    int  // every Nth part: one rank's /send is duplicated at once, another's retried after its answer (default 3; <0 none)
	Calm        bool // no flaky encoder and no metadata lag (the issue-2/3 workload only)
	Log         *zap.Logger
}

func (o *Options) defaults() {
	def := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	def(&o.Encoders, 3)
	def(&o.Requests, 40)
	def(&o.Parts, 3)
	def(&o.ReceiverTP, 2)
	def(&o.Concurrency, 8)
	def(&o.FailEvery, 10)
	def(&o.DupEvery, 3)
	if o.Log == nil {
		o.Log = zap.NewNop()
	}
}

// Result is what the demo saw, for tests and the summary.
type Result struct {
	Calls       map[string]*RouteStats // by route path
	PerEncoder  map[string]int         // /encode calls each encoder received
	PartsServed map[string]int         // part ids each encoder saw
	Received    map[string]int64       // calls the encoders received, by route
	SplitParts  int                    // part ids seen by more than one encoder (must be 0)
	Pins        int
	Errors      map[string]int // "status route: message" -> count

	Phase1          map[string]int // /encode calls per encoder after phase 1
	RetriedOK       int            // answers that took retries and ended 200
	Landed          int            // /sends answered 200, each with its own landing slot
	Verified        int            // of those, slots whose bytes match the staged embedding
	Corrupt         int            // slots whose bytes do not match
	BytesVerified   int64          // bytes checked
	ReceiverWrites  uint64         // writes the receiver applied
	BytesMoved      float64        // bytes the agents wrote
	TransferSeconds float64        // time the agents spent writing them
	Local           int            // failed follow-ups answered by the gateway itself
	Retries         map[string]float64
	Transitions     []string // breaker transitions, "enc-c closed->open x1"

	Acks        int                // acks the ranks received on their PULL sockets, each the part's frame
	AcksWrong   int                // acks whose frame was not the part's
	AcksMissing int                // delivered /sends whose ack never came
	AgentAcks   map[string]float64 // the agents' encgate_agent_acks_total by result
	// AgentRefused is the agents' encgate_agent_unauthorized_total by door:
	// every /send must have carried the gateway's agent token.
	AgentRefused map[string]float64

	DupsInjected  int            // duplicate /sends the driver added
	Replayed      int            // /send answers marked X-Encgate-Replayed
	SendsReceived map[string]int // (req_id, destination) -> /sends the encoders received
	Suppressed    map[string]float64
}

// RouteStats counts the answers callers got on one route.
type RouteStats struct {
	Calls   int
	OK      int
	Failed  int
	Latency []time.Duration
}

// Run starts the fleet and the gateway, drives the workload, prints the
// summary to w and stops everything. It returns an error when an invariant
// (affinity, answers) does not hold.
func Run(ctx context.Context, w io.Writer, opts Options) error {
	opts.defaults()
	slot := tokensPerItem * dim * 2 // one part's bf16 embedding
	nd, err := startNodes(opts.Encoders, opts.Requests*opts.Parts*opts.ReceiverTP*slot, opts.Log)
	if err != nil {
		return err
	}
	defer nd.close()
	fleet, err := startFleet(opts.Encoders, !opts.Calm, nd)
	if err != nil {
		return err
	}
	defer fleet.close()
	reg := prometheus.NewRegistry()
	gw, err := startGateway(fleet, nd, opts.Log, reg)
	if err != nil {
		return err
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = gw.Shutdown(sctx)
	}()
	fmt.Fprintf(w, "encgate demo: %d fake encoders behind one gateway at http://%s (admin http://%s)\n",
		opts.Encoders, gw.Addr(), gw.AdminAddr())
	fmt.Fprintf(w, "workload: %d requests x %d parts, receiver TP=%d; follow-ups race their /encode as in sglang\n",
		opts.Requests, opts.Parts, opts.ReceiverTP)
	if !opts.Calm {
		fmt.Fprintf(w, "faults: every encoder answers each part's first metadata pull with 504 \"encode metadata not ready\";\n"+
			"        %s fails every /encode with 500 in phase 1 and recovers for phase 2\n", fleet.flaky().Stats().Name)
	}
	fmt.Fprintln(w)
	d := newDriver("http://"+gw.Addr(), opts, newLanding(nd.recv))
	start := time.Now()
	half := opts.Requests / 2
	if opts.Calm {
		half = opts.Requests
	}
	d.run(ctx, 0, half)
	phase1 := fleet.encodes()
	if !opts.Calm {
		fleet.recover()
		if err := waitNotOpen(ctx, gw, fleet.flaky().Stats().Name); err != nil {
			return err
		}
		d.run(ctx, half, opts.Requests)
	}
	res := d.result(fleet, gw, reg)
	res.Phase1 = phase1
	res.Verified, res.Corrupt, res.BytesVerified = d.land.verify(nd.recv)
	res.Landed = len(d.land.sent)
	res.ReceiverWrites = nd.recv.Stats().Writes
	res.BytesMoved, res.TransferSeconds = nd.transferred()
	res.AgentAcks = nd.acks()
	res.AgentRefused = nd.refused()
	printSummary(w, res, time.Since(start), opts)
	if err := res.check(opts); err != nil {
		return err
	}
	fmt.Fprintln(w)
	fr, err := fleetPhase(ctx, gw, nd.bootToken)
	if err != nil {
		return err
	}
	printFleet(w, fr)
	return fr.check()
}

// waitNotOpen waits for the recovered encoder's breaker to leave open
// (when its ejection ends it turns half-open, and the next real request it
// gets is its trial).
func waitNotOpen(ctx context.Context, gw *gateway.Server, name string) error {
	e, _ := gw.Pool().Lookup(name)
	deadline := time.Now().Add(10 * time.Second)
	for e.Breaker.State() == upstream.BreakerOpen {
		if time.Now().After(deadline) {
			return fmt.Errorf("%s's breaker stayed open", name)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
	return nil
}

type fleet struct{ encs []*fakeencoder.Encoder }

// flakyFaults make the last encoder fail every /encode, as a GPU that runs
// out of memory would.
var flakyFaults = fakeencoder.Faults{
	FailureRate: 1, FailStatus: 500, FailRoutes: []string{"/encode"},
	FailMessage: "Internal encoding error: CUDA out of memory (injected)",
}

// The demo's embeddings: 64 tokens x 256 dims of bf16 per image (32 KiB).
const (
	tokensPerItem = 64
	dim           = 256
)

func startFleet(n int, faults bool, nd *nodes) (*fleet, error) {
	f := &fleet{}
	for i := 0; i < n; i++ {
		o := fakeencoder.Options{
			Name:          fmt.Sprintf("enc-%c", 'a'+i),
			Mode:          fakeencoder.ModeMooncake,
			EncodeLatency: 5 * time.Millisecond,
			TokensPerItem: tokensPerItem,
			Dim:           dim,
			Stage:         nd.stager(i),
			Faults:        fakeencoder.Faults{MetadataDelay: 2 * time.Millisecond},
		}
		if faults {
			o.Faults.Leading504s = 1                   // metadata lag: the first pull of each part is "not ready"
			o.MetadataTimeout = 500 * time.Millisecond // pulls on a failed encode end soon
			if i == n-1 {
				lag := o.Faults.Leading504s
				o.Faults = flakyFaults
				o.Faults.MetadataDelay, o.Faults.Leading504s = 2*time.Millisecond, lag
			}
		}
		e := fakeencoder.New(o)
		if err := e.Start("127.0.0.1:0"); err != nil {
			f.close()
			return nil, err
		}
		f.encs = append(f.encs, e)
	}
	return f, nil
}

func (f *fleet) flaky() *fakeencoder.Encoder { return f.encs[len(f.encs)-1] }

// recover turns the flaky encoder's /encode failures off.
func (f *fleet) recover() {
	e := f.flaky()
	fs := e.Faults()
	fs.FailureRate = 0
	e.SetFaults(fs)
}

// encodes returns the /encode calls each encoder received so far.
func (f *fleet) encodes() map[string]int {
	out := map[string]int{}
	for _, e := range f.encs {
		st := e.Stats()
		out[st.Name] = int(st.Routes["/encode"])
	}
	return out
}

func (f *fleet) close() {
	for _, e := range f.encs {
		_ = e.Close()
	}
}

func startGateway(f *fleet, nd *nodes, log *zap.Logger, reg *prometheus.Registry) (*gateway.Server, error) {
	cfg := gateway.DefaultConfig()
	cfg.Listen, cfg.AdminListen = "127.0.0.1:0", "127.0.0.1:0"
	for i, e := range f.encs {
		cfg.Encoders = append(cfg.Encoders, upstream.EncoderConfig{Name: e.Stats().Name, URL: e.URL(),
			Agent: nd.agentURL(i), AgentTokenFile: nd.tokenFile})
	}
	// A local fleet needs few descriptors: the defaults (10,000 client
	// connections, 1,024 per encoder and agent) would ask RLIMIT_NOFILE for
	// ~16,000, more than many laptops' hard limit.
	cfg.Limits.MaxConns = 1024
	cfg.Upstream.MaxConnsPerEncoder = 256
	cfg.Breaker.ConsecutiveFailures = 3
	// Short ejections, so that the flaky encoder is back soon after it
	// recovers: 300ms, growing by as much per trip up to 1.2s.
	cfg.Breaker.BaseEjectionTime = configfile.Duration(300 * time.Millisecond)
	cfg.Breaker.MaxEjectionTime = configfile.Duration(1200 * time.Millisecond)
	// sglang's bootstrap API on loopback, its routes under /t/<token>
	// (bootstrap.token_file): the fleet phase's encoder registers there, as
	// sglang's --encoder-register-urls http://HOST:PORT/t/<token> does, and
	// joins after one passed health check.
	cfg.Bootstrap.Listen = "127.0.0.1:0"
	cfg.Bootstrap.TokenFile = nd.bootTokenFile
	cfg.Health.UpAfter = 1
	gw, err := gateway.New(cfg, gateway.Deps{Log: log, Registry: reg})
	if err != nil {
		return nil, err
	}
	return gw, gw.Start()
}

// driver plays sglang's language-only server: the tokenizer posts /encode
// per part while every scheduler rank pulls metadata and posts /send.
type driver struct {
	base   string
	opts   Options
	client *http.Client
	land   *landing

	mu        sync.Mutex // protects calls, errors, dups, replayed and retriedOK
	calls     map[string]*RouteStats
	errors    map[string]int
	dups      int
	replayed  int
	retriedOK int // answers that needed more than one attempt and ended 200
	local     int // follow-up errors the gateway answered itself (no attempt upstream)
	acks      int // acks received with the part's frame
	acksWrong int // acks with another frame
	acksLost  int // delivered /sends whose ack never came
}

func newDriver(base string, opts Options, land *landing) *driver {
	return &driver{
		base: base, opts: opts, land: land,
		client: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 256}, Timeout: 30 * time.Second},
		calls:  map[string]*RouteStats{}, errors: map[string]int{},
	}
}

// run drives requests [from, to).
func (d *driver) run(ctx context.Context, from, to int) {
	sem := make(chan struct{}, d.opts.Concurrency)
	var wg sync.WaitGroup
	for i := from; i < to; i++ {
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			d.request(ctx, i)
		}()
	}
	wg.Wait()
}

// request runs one user request: every part concurrently.
func (d *driver) request(ctx context.Context, i int) {
	rid := fmt.Sprintf("demo-%04d", i)
	var wg sync.WaitGroup
	for k := 0; k < d.opts.Parts; k++ {
		part := fmt.Sprintf("%s_local_part_%d", rid, k)
		media := fmt.Sprintf(`"https://example.com/img-%d-%d.png"`, i, k)
		if d.opts.FailEvery > 0 && i%d.opts.FailEvery == 0 && k == 0 {
			media = fmt.Sprintf(`"fail:400:Error while loading data https://example.com/missing-%d.png: 404 Not Found"`, i)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			d.part(ctx, part, k, media)
		}()
	}
	wg.Wait()
}

// part drives one part id: the ranks start first, as sglang's schedulers
// often do, so their follow-ups wait in the gateway for the /encode's pin.
func (d *driver) part(ctx context.Context, part string, k int, media string) {
	var wg sync.WaitGroup
	dup := d.opts.DupEvery > 0 && d.seq(part)%d.opts.DupEvery == 0
	// Each rank's per-request PULL socket for the ack, bound up front as
	// sglang's ranks bind theirs, and all held until the part is done: a
	// port one rank freed could otherwise be the next rank's, and two ranks
	// of one part on one destination are one destination.
	acks := make([]*ackPort, d.opts.ReceiverTP)
	for r := range acks {
		ack, err := listenAck(ctx)
		if err != nil {
			d.record("/send", 0, "binding the ack socket: "+err.Error(), 0)
			for _, a := range acks[:r] {
				a.close()
			}
			return
		}
		acks[r] = ack
		defer ack.close()
	}
	for r := 0; r < d.opts.ReceiverTP; r++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			meta := fmt.Sprintf(`{"req_id":%q,"part_idx":%d}`, part, k)
			body, ok := d.post(ctx, "/scheduler_receive_meta_data", meta)
			if !ok {
				return
			}
			size := metaSize(body)
			addr, ok := d.land.alloc(uint64(size)) // this rank's landing slot, as its EmbeddingPool gives
			if !ok {
				d.record("/send", 0, "demo receiver buffer full", 0)
				return
			}
			ack := acks[r]
			send := fmt.Sprintf(`{"req_id":%q,"part_idx":%d,"embedding_size":%d,"prefill_host":"127.0.0.1","embedding_port":%d,`+
				`"session_id":%q,"buffer_address":%d,"receive_count":%d}`,
				part, k, size, ack.port, d.land.session, addr, d.opts.ReceiverTP)
			delivered := false
			switch {
			case dup && r == 0: // a confused rank: the same /send twice at once
				d.countDup()
				var both sync.WaitGroup
				var okBoth atomic.Bool
				both.Add(2)
				for i := 0; i < 2; i++ {
					go func() {
						defer both.Done()
						if _, ok := d.post(ctx, "/send", send); ok {
							okBoth.Store(true)
						}
					}()
				}
				both.Wait()
				delivered = okBoth.Load()
			case dup && r == 1: // a retrying middleware: the same /send again after the answer
				_, delivered = d.post(ctx, "/send", send)
				d.countDup()
				d.post(ctx, "/send", send)
			default:
				_, delivered = d.post(ctx, "/send", send)
			}
			if delivered {
				d.land.record(part, addr, size)
				// As sglang's rank: the part is ready only once its ack came.
				frames, err := ack.wait(10 * time.Second)
				d.mu.Lock()
				switch {
				case err != nil:
					d.acksLost++
				case len(frames) == 1 && bytes.Equal(frames[0], ackFrame(part, size/(dim*2), dim)):
					d.acks++
				default:
					d.acksWrong++
				}
				d.mu.Unlock()
			}
		}()
	}
	enc := fmt.Sprintf(`{"req_id":%q,"mm_items":[%s],"modality":"IMAGE","num_parts":%d,"part_idx":%d,`+
		`"prefill_host":"127.0.0.1","embedding_port":null}`, part, media, d.opts.Parts, k)
	_, encoded := d.post(ctx, "/encode", enc)
	wg.Wait()
	if !encoded {
		// A late rank asks again after the failure: the gateway answers it
		// from the remembered /encode, without a round trip.
		d.post(ctx, "/scheduler_receive_meta_data", fmt.Sprintf(`{"req_id":%q,"part_idx":%d}`, part, k))
	}
}

// metaSize reads embedding_size from a metadata answer.
func metaSize(body []byte) int {
	var raw [1][]byte
	if jsonfield.Lookup(body, []string{"embedding_size"}, raw[:]) != nil {
		return 0
	}
	n, _ := jsonfield.Int(raw[0])
	return int(n)
}

func (d *driver) countDup() {
	d.mu.Lock()
	d.dups++
	d.mu.Unlock()
}

// seq is a stable small number for a part id, to pick which parts get duplicates.
func (d *driver) seq(part string) int {
	h := 0
	for _, c := range part {
		h = h*31 + int(c)
	}
	if h < 0 {
		h = -h
	}
	return h
}

func (d *driver) post(ctx context.Context, path, body string) ([]byte, bool) {
	start := time.Now()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, d.base+path, strings.NewReader(body))
	if err != nil {
		d.record(path, 0, err.Error(), 0)
		return nil, false
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := d.client.Do(req)
	if err != nil {
		d.record(path, 0, err.Error(), time.Since(start))
		return nil, false
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	msg := ""
	if resp.StatusCode != http.StatusOK {
		msg = envelopeMessage(out)
	}
	d.mu.Lock()
	if resp.Header.Get("X-Encgate-Replayed") == "true" {
		d.replayed++
	}
	attempts, _ := strconv.Atoi(resp.Header.Get("X-Encgate-Attempts"))
	if attempts > 1 && resp.StatusCode == http.StatusOK {
		d.retriedOK++
	}
	if attempts == 0 && path == "/scheduler_receive_meta_data" && resp.StatusCode != http.StatusOK {
		d.local++
	}
	d.mu.Unlock()
	d.record(path, resp.StatusCode, msg, time.Since(start))
	return out, resp.StatusCode == http.StatusOK
}

func (d *driver) record(path string, status int, msg string, lat time.Duration) {
	d.mu.Lock()
	defer d.mu.Unlock()
	rs := d.calls[path]
	if rs == nil {
		rs = &RouteStats{}
		d.calls[path] = rs
	}
	rs.Calls++
	rs.Latency = append(rs.Latency, lat)
	if status == http.StatusOK {
		rs.OK++
		return
	}
	rs.Failed++
	d.errors[fmt.Sprintf("%d %s: %s", status, path, msg)]++
}

func envelopeMessage(body []byte) string {
	const key = `"message":"`
	i := bytes.Index(body, []byte(key))
	if i < 0 {
		return strings.TrimSpace(string(body))
	}
	rest := body[i+len(key):]
	if j := bytes.IndexByte(rest, '"'); j >= 0 {
		rest = rest[:j]
	}
	m := string(rest)
	// Group per-request messages into one kind.
	if k := strings.Index(m, "https://"); k >= 0 {
		m = m[:k] + "…"
	}
	return m
}

func (d *driver) result(f *fleet, gw *gateway.Server, reg *prometheus.Registry) *Result {
	res := &Result{Calls: d.calls, PerEncoder: map[string]int{}, PartsServed: map[string]int{},
		Received: map[string]int64{}, Errors: d.errors, Pins: gw.Pool().PinsHeld(),
		DupsInjected: d.dups, Replayed: d.replayed, SendsReceived: map[string]int{},
		Suppressed: suppressed(reg), RetriedOK: d.retriedOK, Local: d.local,
		Acks: d.acks, AcksWrong: d.acksWrong, AcksMissing: d.acksLost,
		Retries: counterBy(reg, "encgate_retries_total", "reason"), Transitions: transitions(reg)}
	seen := map[string]int{}
	for _, e := range f.encs {
		st := e.Stats()
		res.PerEncoder[st.Name] = int(st.Routes["/encode"])
		for route, n := range st.Routes {
			res.Received[route] += n
		}
		for key, n := range st.Sends {
			res.SendsReceived[key] += int(n)
		}
		for rid := range st.ReqIDs {
			seen[rid]++
			res.PartsServed[st.Name]++
		}
	}
	for _, n := range seen {
		if n > 1 {
			res.SplitParts++
		}
	}
	return res
}

func (r *Result) check(o Options) error {
	if r.SplitParts > 0 {
		return fmt.Errorf("affinity broken: %d part ids reached more than one encoder", r.SplitParts)
	}
	want := o.Requests * o.Parts
	if got := r.Calls["/encode"]; got == nil || got.Calls != want {
		return fmt.Errorf("expected %d /encode answers", want)
	}
	for kind := range r.Errors {
		if !strings.Contains(kind, "Error while loading data") && !strings.Contains(kind, "CUDA out of memory (injected)") &&
			!strings.Contains(kind, "enc-c holding this req_id is open (circuit breaker)") {
			return fmt.Errorf("unexpected error kind %q", kind)
		}
	}
	if r.Corrupt > 0 || r.Verified != r.Landed || r.Landed == 0 {
		return fmt.Errorf("transfers: %d of %d landings verified, %d corrupt", r.Verified, r.Landed, r.Corrupt)
	}
	if !o.Calm {
		if r.RetriedOK == 0 {
			return fmt.Errorf("no retry ended in a 200")
		}
		if !hasTransition(r.Transitions, "closed->open") || !hasTransition(r.Transitions, "half_open->closed") {
			return fmt.Errorf("the flaky encoder's breaker did not open and close again: %v", r.Transitions)
		}
	}
	if r.answeredByGateway() == 0 && o.FailEvery > 0 {
		return fmt.Errorf("no follow-up of a failed /encode was answered by the gateway")
	}
	for key, n := range r.SendsReceived {
		if n != 1 {
			return fmt.Errorf("duplicate /send reached an encoder: %s received %d times", key, n)
		}
	}
	if r.ReceiverWrites != uint64(r.Landed) {
		return fmt.Errorf("the receiver took %d writes for %d delivered /sends", r.ReceiverWrites, r.Landed)
	}
	if r.AgentRefused["control"] != 0 {
		return fmt.Errorf("agents refused %.0f /sends for a missing or wrong token", r.AgentRefused["control"])
	}
	if r.Acks != r.Landed || r.AcksWrong != 0 || r.AcksMissing != 0 || r.AgentAcks["sent"] != float64(r.Landed) || r.AgentAcks["failed"] != 0 {
		return fmt.Errorf("acks: %d of %d delivered /sends acked (%d with a wrong frame, %d missing); agents: %v",
			r.Acks, r.Landed, r.AcksWrong, r.AcksMissing, r.AgentAcks)
	}
	if o.DupEvery > 0 && r.DupsInjected == 0 {
		return fmt.Errorf("no duplicate /send was injected")
	}
	return nil
}

// answeredByGateway counts metadata pulls the gateway answered itself from
// a remembered failed /encode, without any attempt upstream. (Suppressed
// /send duplicates are counted separately.)
func (r *Result) answeredByGateway() int { return r.Local }

func printSummary(w io.Writer, r *Result, took time.Duration, o Options) {
	fmt.Fprintf(w, "%-30s %7s %7s %8s %9s %9s\n", "route", "calls", "200", "non-200", "p50", "p99")
	paths := []string{"/encode", "/scheduler_receive_meta_data", "/send"}
	for _, p := range paths {
		rs := r.Calls[p]
		if rs == nil {
			continue
		}
		fmt.Fprintf(w, "%-30s %7d %7d %8d %9s %9s\n", p, rs.Calls, rs.OK, rs.Failed,
			pct(rs.Latency, 0.50), pct(rs.Latency, 0.99))
	}
	if r.Phase1 != nil && !o.Calm {
		fmt.Fprintf(w, "\n/encode calls per encoder, phase 1 (flaky) -> phase 2 (recovered):")
		for _, n := range sortedKeys(r.PerEncoder) {
			fmt.Fprintf(w, "  %s %d -> %d", n, r.Phase1[n], r.PerEncoder[n]-r.Phase1[n])
		}
		fmt.Fprintf(w, "\nretries: %s; answers that needed a retry and ended 200: %d\n", formatCounts(r.Retries), r.RetriedOK)
		fmt.Fprintf(w, "breaker transitions: %s\n", strings.Join(r.Transitions, ", "))
	}
	fmt.Fprintf(w, "\nper encoder (/encode calls, part ids served):")
	names := make([]string, 0, len(r.PerEncoder))
	for n := range r.PerEncoder {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(w, "  %s %d/%d", n, r.PerEncoder[n], r.PartsServed[n])
	}
	fmt.Fprintf(w, "\npins held by the gateway: %d\n", r.Pins)
	total := o.Requests * o.Parts
	fmt.Fprintf(w, "affinity: %d of %d part ids had all their calls on one encoder\n", total-r.SplitParts, total)
	fmt.Fprintf(w, "follow-ups of failed /encodes answered by the gateway without a round trip: %d\n", r.answeredByGateway())
	fmt.Fprintf(w, "duplicate /sends injected: %d (a rank sending twice at once, a middleware retrying after the answer)\n", r.DupsInjected)
	fmt.Fprintf(w, "  suppressed by the gateway: %.0f coalesced in flight, %.0f replayed from the store, %.0f after release; answers marked X-Encgate-Replayed: %d\n",
		r.Suppressed["inflight"], r.Suppressed["replay"], r.Suppressed["released"], r.Replayed)
	fmt.Fprintf(w, "  the receiver took exactly one write per delivered (req_id, destination): %d writes for %d /sends\n",
		r.ReceiverWrites, r.Landed)
	gbps, mean := 0.0, 0.0
	if took > 0 {
		gbps = r.BytesMoved / took.Seconds() / 1e9
	}
	if r.Landed > 0 {
		mean = r.TransferSeconds / float64(r.Landed) * 1e3
	}
	fmt.Fprintf(w, "transfers: the agents moved %.1f MiB over Mooncake TCP in %d transfers of %d KiB, %.3f GB/s over the run\n"+
		"  (%.1f ms per transfer on average; small parts on 2 shared cores: latency, not bandwidth)\n"+
		"  checksums verified at the receiver: %d of %d landings (%.1f MiB), %d corrupt\n",
		r.BytesMoved/(1<<20), r.Landed, tokensPerItem*dim*2>>10, gbps, mean,
		r.Verified, r.Landed, float64(r.BytesVerified)/(1<<20), r.Corrupt)
	fmt.Fprintf(w, "acks: %d of %d delivered /sends acked on the rank's ZMQ PULL socket with the part's frame (%d wrong, %d missing)\n"+
		"  agents: %.0f sent, %.0f failed, %.0f skipped; staged over their Unix sockets, every /send with the gateway's agent token (%.0f refused)\n",
		r.Acks, r.Landed, r.AcksWrong, r.AcksMissing, r.AgentAcks["sent"], r.AgentAcks["failed"], r.AgentAcks["skipped"],
		r.AgentRefused["control"])
	fmt.Fprintf(w, "errors by kind (each from an injected fault: media that failed to load, or the flaky encoder):\n")
	if len(r.Errors) == 0 {
		fmt.Fprintln(w, "  none")
	}
	kinds := make([]string, 0, len(r.Errors))
	for k := range r.Errors {
		kinds = append(kinds, k)
	}
	sort.Strings(kinds)
	for _, k := range kinds {
		fmt.Fprintf(w, "  %4dx %s\n", r.Errors[k], k)
	}
	fmt.Fprintf(w, "done in %s\n", took.Round(time.Millisecond))
}

func pct(ds []time.Duration, q float64) string {
	if len(ds) == 0 {
		return "-"
	}
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[int(q*float64(len(s)-1))].Round(10 * time.Microsecond).String()
}

// suppressed reads encgate_send_duplicates_suppressed_total by reason.
func suppressed(reg *prometheus.Registry) map[string]float64 {
	out := map[string]float64{}
	mfs, err := reg.Gather()
	if err != nil {
		return out
	}
	for _, mf := range mfs {
		if mf.GetName() != "encgate_send_duplicates_suppressed_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "reason" {
					out[l.GetValue()] = m.GetCounter().GetValue()
				}
			}
		}
	}
	return out
}

// counterBy sums a counter by one label.
func counterBy(reg *prometheus.Registry, name, label string) map[string]float64 {
	out := map[string]float64{}
	mfs, _ := reg.Gather()
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == label {
					out[l.GetValue()] += m.GetCounter().GetValue()
				}
			}
		}
	}
	return out
}

// transitions lists breaker state changes as "enc from->to xN".
func transitions(reg *prometheus.Registry) []string {
	var out []string
	mfs, _ := reg.Gather()
	for _, mf := range mfs {
		if mf.GetName() != "encgate_breaker_transitions_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			l := map[string]string{}
			for _, p := range m.GetLabel() {
				l[p.GetName()] = p.GetValue()
			}
			out = append(out, fmt.Sprintf("%s %s->%s x%.0f", l["encoder"], l["from"], l["to"], m.GetCounter().GetValue()))
		}
	}
	sort.Strings(out)
	return out
}

func hasTransition(ts []string, fromTo string) bool {
	for _, t := range ts {
		if strings.Contains(t, " "+fromTo+" ") {
			return true
		}
	}
	return false
}

func formatCounts(m map[string]float64) string {
	if len(m) == 0 {
		return "none"
	}
	var parts []string
	for _, k := range sortedKeys(m) {
		parts = append(parts, fmt.Sprintf("%.0f on %s", m[k], k))
	}
	return strings.Join(parts, ", ")
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
