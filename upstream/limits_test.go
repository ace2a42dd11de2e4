package upstream

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/valyala/fasthttp"

	"github.com/encgate/encgate/internal/sglang"
)

func TestPollBound(t *testing.T) {
	for _, c := range []struct {
		total int
		share float64
		want  int
	}{
		{32, 0.75, 24},
		{1024, 0.75, 768},
		{100, 0.29, 29}, // 0.29 × 100 is 28.999… in floating point
		{10, 0.7, 7},
		{3, 0.5, 1},
		{32, 0.01, 1}, // at least 1
		{2, 0.99, 1},  // below the total
		{1, 0.75, 1},  // a total of 1: the long polls share its slot
	} {
		if got := PollBound(c.total, c.share); got != c.want {
			t.Errorf("PollBound(%d, %g) = %d, want %d", c.total, c.share, got, c.want)
		}
	}
}

// limitedEncoder is an encoder outside a pool under the given bounds.
func limitedEncoder(total int, share float64) (*Encoder, *atomic.Pointer[inflightLimits]) {
	var lim atomic.Pointer[inflightLimits]
	lim.Store(newInflightLimits(total, share))
	return &Encoder{Name: "enc-1", limits: &lim}, &lim
}

func wantRefusal(t *testing.T, err error, polls bool, limit int64) {
	t.Helper()
	var le *InflightLimitError
	if !errors.As(err, &le) || le.Polls != polls || le.Limit != limit {
		t.Fatalf("got %v, want a refusal by the %s bound %d", err, map[bool]string{true: "long polls'", false: "total"}[polls], limit)
	}
	if !errors.Is(err, fasthttp.ErrNoFreeConns) {
		t.Fatalf("%v does not unwrap to ErrNoFreeConns", err)
	}
}

// Long polls are admitted up to their own bound; what is left of the total
// stays for the other calls, which the total alone bounds; a refusal
// leaves both counts as they were and names the bound that refused.
func TestAcquireKeepsTheReserveFromLongPolls(t *testing.T) {
	e, _ := limitedEncoder(8, 0.5) // long polls: 4
	for i := 0; i < 4; i++ {
		if err := e.acquire(true); err != nil {
			t.Fatalf("long poll %d: %v", i, err)
		}
	}
	err := e.acquire(true)
	wantRefusal(t, err, true, 4)
	if want := "upstream: encoder enc-1 already holds 4 long polls (metadata pulls and registrations of parts not yet encoded; " +
		"limits.poll_share 0.5 of limits.max_inflight_per_encoder 8)"; err.Error() != want {
		t.Fatalf("message %q, want %q", err, want)
	}
	for i := 0; i < 4; i++ { // the reserve
		if err := e.acquire(false); err != nil {
			t.Fatalf("call %d in the reserve: %v", i, err)
		}
	}
	err = e.acquire(false)
	wantRefusal(t, err, false, 8)
	if want := "upstream: encoder enc-1 already has 8 requests in flight (limits.max_inflight_per_encoder)"; err.Error() != want {
		t.Fatalf("message %q, want %q", err, want)
	}
	// A long poll below its own bound is still refused by the total.
	e.release(true)
	if err := e.acquire(false); err != nil {
		t.Fatal(err)
	}
	wantRefusal(t, e.acquire(true), false, 8)
	if e.Polls() != 3 || e.Inflight() != 8 || e.Requests() != 9 {
		t.Fatalf("polls %d, inflight %d, requests %d; want 3, 8, 9", e.Polls(), e.Inflight(), e.Requests())
	}
	for i := 0; i < 3; i++ {
		e.release(true)
	}
	for i := 0; i < 5; i++ {
		e.release(false)
	}
	if e.Polls() != 0 || e.Inflight() != 0 {
		t.Fatalf("after every release: polls %d, inflight %d", e.Polls(), e.Inflight())
	}

	// No share (Settings.PollShare 0): long polls have only the total.
	e, _ = limitedEncoder(3, 0)
	for i := 0; i < 3; i++ {
		if err := e.acquire(true); err != nil {
			t.Fatal(err)
		}
	}
	wantRefusal(t, e.acquire(true), false, 3)
}

// Goroutines that each hold a long poll or another call, under -race: the
// admitted never pass either bound, and once the long polls hold their
// bound a storm of more long polls leaves the whole reserve to the other
// calls, every one of them admitted at once.
func TestAcquireUnderConcurrency(t *testing.T) {
	// Small bounds, so that the goroutines meet them.
	const smallTotal, smallBound = 6, 3
	e, _ := limitedEncoder(smallTotal, 0.5)
	var polls, all, maxPolls, maxAll atomic.Int64
	raise := func(m *atomic.Int64, v int64) {
		for cur := m.Load(); v > cur && !m.CompareAndSwap(cur, v); cur = m.Load() {
		}
	}
	var wg sync.WaitGroup
	for g := 0; g < 16; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 2000; i++ {
				poll := (g+i)%3 != 0
				if e.acquire(poll) != nil {
					continue
				}
				if poll {
					raise(&maxPolls, polls.Add(1))
				}
				raise(&maxAll, all.Add(1))
				runtime.Gosched() // hold it a while
				all.Add(-1)
				if poll {
					polls.Add(-1)
				}
				e.release(poll)
			}
		}()
	}
	wg.Wait()
	t.Logf("most admitted at once: %d long polls (bound %d), %d in all (bound %d)", maxPolls.Load(), smallBound, maxAll.Load(), smallTotal)
	if maxPolls.Load() > smallBound || maxAll.Load() > smallTotal {
		t.Fatalf("admitted %d long polls and %d in all at once, past %d and %d", maxPolls.Load(), maxAll.Load(), smallBound, smallTotal)
	}
	if e.Polls() != 0 || e.Inflight() != 0 {
		t.Fatalf("left counted: polls %d, inflight %d", e.Polls(), e.Inflight())
	}

	const total, share, bound = 32, 0.75, 24
	e, _ = limitedEncoder(total, share)

	for i := 0; i < bound; i++ {
		if err := e.acquire(true); err != nil {
			t.Fatal(err)
		}
	}
	stop := make(chan struct{})
	var storm sync.WaitGroup
	var refused atomic.Int64
	for g := 0; g < 8; g++ {
		storm.Add(1)
		go func() {
			defer storm.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				if e.acquire(true) == nil {
					e.release(true)
					t.Error("a long poll past the bound was admitted")
					return
				}
				refused.Add(1)
			}
		}()
	}
	errs := make(chan error, total-bound)
	for i := 0; i < total-bound; i++ {
		go func() { errs <- e.acquire(false) }()
	}
	for i := 0; i < total-bound; i++ {
		if err := <-errs; err != nil {
			t.Errorf("a call in the reserve beside a storm of long polls: %v", err)
		}
	}
	close(stop)
	storm.Wait()
	t.Logf("%d long polls refused while the %d reserved places were taken", refused.Load(), total-bound)
	wantRefusal(t, e.acquire(false), false, total)
}

// holdingEncoder answers every POST 200 at once, except a body naming a
// req_id that starts with "hold": that one is announced on arrived and
// held until release is called (or the client goes).
func holdingEncoder(t *testing.T) (srv *httptest.Server, arrived chan string, release func()) {
	t.Helper()
	arrived = make(chan string, 64)
	ch := make(chan struct{})
	var once sync.Once
	release = func() { once.Do(func() { close(ch) }) }
	srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if s := string(body); strings.Contains(s, `"req_id":"hold`) {
			arrived <- s
			select {
			case <-ch:
			case <-r.Context().Done():
			}
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"ok":true}`)
	}))
	t.Cleanup(srv.Close)
	t.Cleanup(release) // runs first: the server's Close waits for its handlers
	return srv, arrived, release
}

// Through Exchange: a pull or registration of a part with no pin or a
// pending one is a long poll, refused past limits.poll_share with nothing
// sent; one of an encoded part, a /send and an /encode are not, and go on
// the reserve. A reload changes the share at once, for the held and the
// new alike.
func TestExchangeClassesLongPolls(t *testing.T) {
	srv, arrived, release := holdingEncoder(t)
	set := testSettings("enc-1", srv.URL)
	set.MaxInflight, set.PollShare = 4, 0.5 // long polls: 2
	set.Retry.Metadata.MaxAttempts = 1
	set.Retry.ReceiveURL.MaxAttempts = 1
	reg := prometheus.NewRegistry()
	p := newTestPool(t, set, reg)
	e, _ := p.Lookup("enc-1")

	held := make(chan Result, 8)
	hold := func(c *Call) {
		t.Helper()
		go func() { held <- p.Exchange(c) }()
		<-arrived
	}
	hold(newCall(sglang.RouteMetadata, "hold-unknown_local_part_0"))
	p.pins.Set("hold-pending_local_part_0", "enc-1", e.ID()) // its /encode still running
	hold(newCall(sglang.RouteMetadata, "hold-pending_local_part_0"))
	if e.Polls() != 2 || e.Inflight() != 2 {
		t.Fatalf("polls %d, inflight %d; want 2, 2", e.Polls(), e.Inflight())
	}

	const pollMsg = "encgate: encoder enc-1 already holds 2 long polls (metadata pulls and registrations of parts not yet encoded; " +
		"limits.poll_share 0.5 of limits.max_inflight_per_encoder 4); try again later"
	p.pins.Set("pending_local_part_0", "enc-1", e.ID())
	for _, c := range []*Call{
		newCall(sglang.RouteMetadata, "unknown_local_part_0"),
		newCall(sglang.RouteMetadata, "pending_local_part_0"),
		newCall(sglang.RouteReceiveURL, "unknown_local_part_0"),
	} {
		res := p.Exchange(c)
		if v := res.Verdict; v.Kind != KindRefused || v.Delivery != NotSent || v.Status != 503 || v.Message != pollMsg {
			t.Fatalf("%s of %s past the long polls' bound: %+v", c.Route.Path, c.ReqID, v)
		}
	}

	// A pull of a part encoded (the pin read as the attempt is picked),
	// a /send and an /encode: the reserve.
	p.pins.Set("done_local_part_0", "enc-1", e.ID())
	p.pins.Encoded("done_local_part_0", e.ID())
	for _, c := range []*Call{
		newCall(sglang.RouteMetadata, "done_local_part_0"),
		newCall(sglang.RouteReceiveURL, "done_local_part_0"),
		newCall(sglang.RouteSend, "pending_local_part_0"),
		newCall(sglang.RouteEncode, "new_local_part_0"),
	} {
		if res := p.Exchange(c); res.Verdict.Kind != KindAnswered || res.Verdict.Status != 200 {
			t.Fatalf("%s of %s beside held long polls: %+v", c.Route.Path, c.ReqID, res.Verdict)
		}
	}
	if got := testutil.ToFloat64(p.m.refused.WithLabelValues("enc-1", RefusedPollShare)); got != 3 {
		t.Errorf("poll_share refusals %g, want 3", got)
	}
	if got := testutil.ToFloat64(p.m.refused.WithLabelValues("enc-1", RefusedMaxInflight)); got != 0 {
		t.Errorf("max_inflight refusals %g, want 0", got)
	}
	if got := testutil.ToFloat64(p.m.polls.WithLabelValues("enc-1")); got != 2 {
		t.Errorf("polls gauge %g, want 2", got)
	}
	if got := testutil.ToFloat64(p.m.outcomes.WithLabelValues("enc-1", MarkFault.String())); got != 0 {
		t.Errorf("refusals counted as breaker faults: %g", got)
	}

	// Reload: share 0.75 of 4 is 3, so one more long poll is held.
	set.PollShare = 0.75
	if _, _, err := p.Reload(set); err != nil {
		t.Fatal(err)
	}
	if e2, _ := p.Lookup("enc-1"); e2 != e {
		t.Fatal("the reload rebuilt the encoder")
	}
	hold(newCall(sglang.RouteReceiveURL, "hold-third_local_part_0"))
	// Down to 0.25 (1): the three held stay; a new long poll is refused
	// under the new bound, the reserve still answers.
	set.PollShare = 0.25
	if _, _, err := p.Reload(set); err != nil {
		t.Fatal(err)
	}
	res := p.Exchange(newCall(sglang.RouteMetadata, "unknown_local_part_0"))
	if want := "encgate: encoder enc-1 already holds 1 long polls (metadata pulls and registrations of parts not yet encoded; " +
		"limits.poll_share 0.25 of limits.max_inflight_per_encoder 4); try again later"; res.Verdict.Message != want {
		t.Fatalf("after the reload to 0.25: %+v", res.Verdict)
	}
	if res := p.Exchange(newCall(sglang.RouteMetadata, "done_local_part_0")); res.Verdict.Status != 200 {
		t.Fatalf("an encoded part's pull after the reload: %+v", res.Verdict)
	}
	if e.Polls() != 3 || e.Inflight() != 3 {
		t.Fatalf("polls %d, inflight %d; want the 3 held", e.Polls(), e.Inflight())
	}
	release()
	for i := 0; i < 3; i++ {
		if r := <-held; r.Verdict.Status != 200 {
			t.Errorf("held long poll: %+v", r.Verdict)
		}
	}
	if e.Polls() != 0 || e.Inflight() != 0 || testutil.ToFloat64(p.m.polls.WithLabelValues("enc-1")) != 0 {
		t.Fatalf("after the release: polls %d, inflight %d", e.Polls(), e.Inflight())
	}
}

// The class is read from the pin each time an attempt is picked: a pull
// retried after its part was encoded is no longer a long poll.
func TestPinnedClassesEachAttempt(t *testing.T) {
	p := newTestPool(t, testSettings("enc-1", "http://127.0.0.1:1"), prometheus.NewRegistry())
	e, _ := p.Lookup("enc-1")
	const id = "retry_local_part_0"
	s := &pinned{p: p, c: newCall(sglang.RouteMetadata, id)}
	if tg, end, ok := s.pick(1, false); end != nil || !ok || !tg.poll {
		t.Fatalf("no pin: %+v %v %v, want a long poll", tg, end, ok)
	}
	p.pins.Set(id, "enc-1", e.ID())
	if tg, _, _ := s.pick(2, false); !tg.poll {
		t.Fatal("a pending pin: not a long poll")
	}
	p.pins.Encoded(id, e.ID())
	if tg, _, _ := s.pick(3, false); tg.poll {
		t.Fatal("an encoded pin: still a long poll")
	}
	s2 := &pinned{p: p, c: newCall(sglang.RouteMetadata, id)}
	if tg, _, _ := s2.pick(1, false); tg.poll {
		t.Fatal("a pull arriving after the encode: a long poll")
	}
	s3 := &pinned{p: p, c: newCall(sglang.RouteSend, "other_local_part_0")}
	if tg, _, _ := s3.pick(1, false); tg.poll {
		t.Fatal("a /send: a long poll")
	}
}
