package upstream

import (
	"bytes"
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/internal/sglang"
)

// affinityRig is a pool over encoders enc-0 … enc-(n-1), each an HTTP
// server that answers an /encode 200 at once and holds every metadata pull
// until the rig releases them, so that a test sets each encoder's
// in-flight count by holding pulls pinned to it.
type affinityRig struct {
	p       *Pool
	set     Settings
	release chan struct{}
	held    sync.WaitGroup
	seq     int
}

func contentAffinity() AffinityConfig {
	aff := DefaultAffinity()
	aff.EncodeBy = EncodeByContent
	return aff
}

func newAffinityRig(t *testing.T, aff AffinityConfig, n int, mutate func(*Settings)) *affinityRig {
	t.Helper()
	r := &affinityRig{release: make(chan struct{})}
	var pairs []string
	for i := 0; i < n; i++ {
		name := fmt.Sprintf("enc-%d", i)
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
			if req.URL.Path == sglang.PathMetadata {
				select {
				case <-r.release:
				case <-req.Context().Done():
				}
			}
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprintf(w, `{"encoder":%q}`, name)
		}))
		t.Cleanup(srv.Close)
		pairs = append(pairs, name, srv.URL)
	}
	r.set = testSettings(pairs...)
	if mutate != nil {
		mutate(&r.set)
	}
	aff.UnknownWait = 0
	p, err := NewPool(r.set, aff, Deps{Log: zap.NewNop(), Registry: prometheus.NewRegistry(),
		Clock: clock.NewFake(time.Unix(1e9, 0)), Rand: func() float64 { return 0 }})
	if err != nil {
		t.Fatal(err)
	}
	r.p = p
	t.Cleanup(p.Close)
	t.Cleanup(r.unhold) // first: the held pulls end before the pool and servers close
	return r
}

// hold leaves k more metadata pulls in flight on the encoder called name.
func (r *affinityRig) hold(t *testing.T, name string, k int) {
	t.Helper()
	e, ok := r.p.Lookup(name)
	if !ok {
		t.Fatalf("no encoder %s", name)
	}
	want := e.Inflight() + int64(k)
	for i := 0; i < k; i++ {
		r.seq++
		id := fmt.Sprintf("held-%s-%d_local_part_0", name, r.seq)
		r.p.pins.Set(id, name, e.ID())
		r.held.Add(1)
		go func() {
			defer r.held.Done()
			r.p.Exchange(newCall(sglang.RouteMetadata, id))
		}()
	}
	waitInflight(t, e, want)
}

// unhold answers every held pull and waits for their exchanges to end.
func (r *affinityRig) unhold() {
	select {
	case <-r.release:
	default:
		close(r.release)
	}
	r.held.Wait()
}

// media is the mm_items value of conversation image i.
func media(i int) []byte {
	return []byte(fmt.Sprintf(`["https://img.example/conv-%d/img-0.png"]`, i))
}

// encodeCall is an /encode of id whose body carries mm_items, PlaceKey a
// view of those bytes in the body, as the gateway builds it.
func encodeCall(id string, mmItems []byte) *Call {
	body := []byte(`{"req_id":"` + id + `","modality":"IMAGE","mm_items":` + string(mmItems) + `,"num_parts":1,"part_idx":0}`)
	at := bytes.Index(body, mmItems)
	c := newCall(sglang.RouteEncode, id)
	c.Body, c.PlaceKey = body, body[at:at+len(mmItems)]
	return c
}

// contentOrder is the rendezvous order of the usable encoders for m.
func contentOrder(p *Pool, m []byte) []string {
	return names(p.RankedBy(contentHash(m), nil))
}

// twoOwners returns two req_ids whose rendezvous owners differ from each
// other, the first's also from not.
func twoOwners(t *testing.T, p *Pool, not, prefix string) (string, string) {
	t.Helper()
	var a string
	for i := 0; i < 1000; i++ {
		id := fmt.Sprintf("%s-%d_local_part_0", prefix, i)
		o, err := p.Owner(id)
		if err != nil {
			t.Fatal(err)
		}
		switch {
		case a == "" && o.Name != not:
			a = id
		case a != "":
			if oa, _ := p.Owner(a); oa.Name != o.Name {
				return a, id
			}
		}
	}
	t.Fatal("no two req_ids with different owners")
	return "", ""
}

func exchangeOn(t *testing.T, p *Pool, c *Call) string {
	t.Helper()
	res := p.Exchange(c)
	if v := res.Verdict; v.Kind != KindAnswered || v.Status != 200 {
		t.Fatalf("%s %s: %+v", c.Route.Path, c.ReqID, v)
	}
	return res.Verdict.Encoder
}

// With encode_by content, /encodes of the same media go to the same
// encoder, the rendezvous owner of the media's hash, whatever their
// req_ids; each req_id is pinned there and its follow-ups follow the pin.
func TestContentPlacementFollowsTheMedia(t *testing.T) {
	r := newAffinityRig(t, contentAffinity(), 4, nil)
	p := r.p
	seen := map[string]bool{}
	for i := 0; i < 40; i++ {
		m := media(i)
		want := contentOrder(p, m)[0]
		seen[want] = true
		a, b := twoOwners(t, p, want, fmt.Sprintf("m%d", i))
		for _, id := range []string{a, b} {
			if got := exchangeOn(t, p, encodeCall(id, m)); got != want {
				t.Fatalf("media %d, %s (req_id owner %s): /encode went to %s, want the media's owner %s",
					i, id, mustOwner(t, p, id), got, want)
			}
			if pin, ok := p.pins.Get(id); !ok || pin.Encoder != want || pin.State != PinEncoded {
				t.Fatalf("%s: pin %+v %v, want encoded on %s", id, pin, ok, want)
			}
			for _, rt := range []*sglang.Route{sglang.RouteReceiveURL, sglang.RouteSend} {
				if got := exchangeOn(t, p, newCall(rt, id)); got != want {
					t.Fatalf("%s %s went to %s, not to its pin %s", rt.Path, id, got, want)
				}
			}
		}
	}
	if len(seen) != 4 {
		t.Errorf("40 media values placed on %d of 4 encoders", len(seen))
	}
	// A second /encode of a pinned req_id (a GEN0 sibling rank's) follows
	// the pin, whatever its media.
	a, _ := twoOwners(t, p, "", "sibling")
	m0 := media(0)
	first := exchangeOn(t, p, encodeCall(a, m0))
	var other []byte
	for i := 1; other == nil; i++ {
		if contentOrder(p, media(i))[0] != first {
			other = media(i)
		}
	}
	if got := exchangeOn(t, p, encodeCall(a, other)); got != first {
		t.Errorf("a pinned req_id's second /encode went to %s, not to its pin %s", got, first)
	}
}

func mustOwner(t *testing.T, p *Pool, id string) string {
	t.Helper()
	o, err := p.Owner(id)
	if err != nil {
		t.Fatal(err)
	}
	return o.Name
}

// With encode_by req_id (the default) the media changes nothing: each
// /encode goes to its req_id's rendezvous owner, and so does a follow-up
// that comes before any /encode.
func TestReqIDPlacementIgnoresTheMedia(t *testing.T) {
	r := newAffinityRig(t, DefaultAffinity(), 4, nil)
	p := r.p
	m := media(7)
	a, b := twoOwners(t, p, "", "rid")
	for _, id := range []string{a, b} {
		if got, want := exchangeOn(t, p, encodeCall(id, m)), mustOwner(t, p, id); got != want {
			t.Errorf("%s: /encode went to %s, want its req_id owner %s", id, got, want)
		}
	}
	// Content placement on, an unpinned follow-up still goes to its req_id
	// owner: it carries no media.
	rc := newAffinityRig(t, contentAffinity(), 4, nil)
	id := ownedBy(t, rc.p, "enc-2", "early")
	if got := exchangeOn(t, rc.p, newCall(sglang.RouteReceiveURL, id)); got != "enc-2" {
		t.Errorf("an unpinned follow-up under content placement went to %s, want its req_id owner enc-2", got)
	}
	// An /encode without media to hash (nil PlaceKey) is placed by req_id.
	c := encodeCall(ownedBy(t, rc.p, "enc-1", "nokey"), m)
	c.PlaceKey = nil
	if got := exchangeOn(t, rc.p, c); got != "enc-1" {
		t.Errorf("an /encode with no PlaceKey went to %s, want its req_id owner enc-1", got)
	}
}

// Bounded load: the media's owner keeps it while it holds no more than
// load_factor × the mean in flight (counting the new part), and passes it
// to the next in rendezvous order once it would hold more.
func TestContentPlacementBoundsTheLoad(t *testing.T) {
	r := newAffinityRig(t, contentAffinity(), 4, nil)
	p := r.p
	m := media(3)
	order := contentOrder(p, m)
	owner, next := order[0], order[1]
	fresh := func(what string) string { r.seq++; return fmt.Sprintf("%s-%d_local_part_0", what, r.seq) }

	// One in flight everywhere: capacity ceil(1.25 × 5/4) = 2, and the
	// owner would hold 2.
	for _, n := range order {
		r.hold(t, n, 1)
	}
	if got := exchangeOn(t, p, encodeCall(fresh("even"), m)); got != owner {
		t.Fatalf("with one in flight on each encoder the media went to %s, want its owner %s", got, owner)
	}
	// The owner holds one more: capacity ceil(1.25 × 6/4) = 2, the owner
	// would hold 3, the next in order 2.
	r.hold(t, owner, 1)
	id := fresh("over")
	if got := exchangeOn(t, p, encodeCall(id, m)); got != next {
		t.Fatalf("with the owner over the bound the media went to %s, want the next in order %s (order %v)", got, next, order)
	}
	if pin, _ := p.pins.Get(id); pin.Encoder != next {
		t.Fatalf("the moved /encode is pinned to %s, want %s", pin.Encoder, next)
	}
	if got := exchangeOn(t, p, newCall(sglang.RouteReceiveURL, id)); got != next {
		t.Fatalf("the moved part's follow-up went to %s, want %s", got, next)
	}
	// Both first two over the bound (3, 3, 1, 1: capacity ceil(1.25 ×
	// 9/4) = 3): the third in order takes it.
	r.hold(t, owner, 1)
	r.hold(t, next, 2)
	if got := exchangeOn(t, p, encodeCall(fresh("both"), m)); got != order[2] {
		t.Fatalf("with the first two over the bound the media went to %s, want %s (order %v)", got, order[2], order)
	}
	// Released, the owner takes its media again.
	r.unhold()
	for _, n := range order {
		e, _ := p.Lookup(n)
		waitInflight(t, e, 0)
	}
	if got := exchangeOn(t, p, encodeCall(fresh("idle"), m)); got != owner {
		t.Fatalf("idle again, the media went to %s, want its owner %s", got, owner)
	}
}

// A draining or unusable encoder never takes an /encode placed by content,
// not even when it is the media's owner and the only idle one.
func TestContentPlacementSkipsDrainingAndUnusable(t *testing.T) {
	r := newAffinityRig(t, contentAffinity(), 4, nil)
	p := r.p
	// The media values whose owner is enc-0 or enc-1, found before the
	// fleet changes.
	var ms [][]byte
	for i := 0; len(ms) < 10; i++ {
		if o := contentOrder(p, media(i))[0]; o == "enc-0" || o == "enc-1" {
			ms = append(ms, media(i))
		}
	}
	r.set.Encoders[0].Draining = true
	if _, _, err := p.Reload(r.set); err != nil {
		t.Fatal(err)
	}
	bad, _ := p.Lookup("enc-1")
	bad.SetUsable(false)
	// enc-2 and enc-3 are busy, enc-0 and enc-1 idle: by load alone the
	// two left out would win.
	r.hold(t, "enc-2", 3)
	r.hold(t, "enc-3", 3)
	for i, m := range ms {
		if got := exchangeOn(t, p, encodeCall(fmt.Sprintf("skip-%d_local_part_0", i), m)); got != "enc-2" && got != "enc-3" {
			t.Errorf("media %s went to %s (draining: enc-0, unusable: enc-1)", m, got)
		}
	}
	for _, m := range ms {
		got := names(p.RankedBy(contentHash(m), nil))
		if len(got) != 2 || got[0] == got[1] || (got[0] != "enc-2" && got[0] != "enc-3") || (got[1] != "enc-2" && got[1] != "enc-3") {
			t.Errorf("RankedBy lists %v, want only enc-2 and enc-3", got)
		}
	}
}

// An /encode placed by content whose encoder refuses the connection (nothing
// sent) goes to the next in the media's order and is re-pinned there.
func TestContentPlacementRetriesOnTheNextInOrder(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := "http://" + ln.Addr().String()
	_ = ln.Close() // connects are refused from here on
	var m []byte
	var order []string
	r := newAffinityRig(t, contentAffinity(), 4, func(set *Settings) {
		// enc-0 listens nowhere; the media is one that enc-0 owns.
		set.Encoders[0].URL = dead
	})
	for i := 0; m == nil; i++ {
		if o := contentOrder(r.p, media(i)); o[0] == "enc-0" {
			m, order = media(i), o
		}
	}
	id := ownedBy(t, r.p, order[2], "retry") // its req_id owner is neither of the first two
	res := r.p.Exchange(encodeCall(id, m))
	if v := res.Verdict; v.Status != 200 || v.Encoder != order[1] || res.Attempts != 2 {
		t.Fatalf("/encode whose media owner is down: %+v after %d attempts, want 200 on %s after 2", v, res.Attempts, order[1])
	}
	if pin, _ := r.p.pins.Get(id); pin.Encoder != order[1] || pin.State != PinEncoded {
		t.Fatalf("pin after the retry: %+v, want encoded on %s", pin, order[1])
	}
}

func withInflight(es []*Encoder, loads ...int64) []*Encoder {
	for i, e := range es {
		e.inflight.Store(loads[i])
	}
	return es
}

func TestBoundLoadKeepsOrderWithinEachGroup(t *testing.T) {
	for _, c := range []struct {
		loads []int64
		want  string
	}{
		{[]int64{0, 0, 0, 0}, "a,b,c,d"}, // capacity 1: all fit
		{[]int64{1, 0, 0, 0}, "b,c,d,a"}, // capacity ceil(1.25×2/4) = 1
		{[]int64{1, 1, 1, 1}, "a,b,c,d"}, // capacity 2: all fit
		{[]int64{2, 1, 1, 1}, "b,c,d,a"}, // capacity 2, a would hold 3
		{[]int64{2, 2, 0, 0}, "c,d,a,b"}, // capacity 2
		{[]int64{3, 0, 3, 0}, "b,d,a,c"}, // capacity ceil(8.75/4) = 3
		{[]int64{8, 8, 8, 0}, "d,a,b,c"}, // capacity ceil(31.25/4) = 8
		{[]int64{7, 8, 8, 1}, "a,d,b,c"}, // capacity 8: a fits
	} {
		list := withInflight(encs("a", "b", "c", "d"), c.loads...)
		boundLoad(list, 1.25)
		if got := strings.Join(names(list), ","); got != c.want {
			t.Errorf("loads %v: order %s, want %s", c.loads, got, c.want)
		}
	}
	// One encoder is left as it is, whatever its load.
	one := withInflight(encs("a"), 100)
	boundLoad(one, 1.25)
	if one[0].Name != "a" {
		t.Errorf("a fleet of one: %v", names(one))
	}
}

// Whatever the loads, the first encoder after boundLoad fits the bound (so
// no /encode is refused placement for balance alone), the order is a
// permutation, and every encoder over the bound comes after every one under.
func TestBoundLoadPutsAFittingEncoderFirst(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for round := 0; round < 2000; round++ {
		n := 1 + rng.IntN(12)
		factor := 1 + rng.Float64()*2
		ids := make([]string, n)
		loads := make([]int64, n)
		var total int64
		for i := range ids {
			ids[i] = fmt.Sprintf("e%d", i)
			loads[i] = int64(rng.IntN(50))
			if rng.IntN(3) == 0 {
				loads[i] = 0
			}
			total += loads[i]
		}
		list := withInflight(encs(ids...), loads...)
		boundLoad(list, factor)
		capacity := int64(math.Ceil(factor * float64(total+1) / float64(n)))
		if n > 1 && list[0].Inflight()+1 > capacity {
			t.Fatalf("loads %v factor %.3f: first is %s holding %d, over capacity %d", loads, factor, list[0].Name, list[0].Inflight(), capacity)
		}
		seen := map[string]bool{}
		over := false
		for _, e := range list {
			seen[e.Name] = true
			if e.Inflight()+1 > capacity {
				over = true
			} else if over && n > 1 {
				t.Fatalf("loads %v factor %.3f: %s fits but comes after one over the bound: %v", loads, factor, e.Name, names(list))
			}
		}
		if len(seen) != n {
			t.Fatalf("loads %v: boundLoad lost encoders: %v", loads, names(list))
		}
	}
}

// Placing an /encode by content allocates nothing: the hash reads the
// body's bytes where they are.
func TestContentPlacementAllocs(t *testing.T) {
	r := newAffinityRig(t, contentAffinity(), 4, nil)
	c := encodeCall("allocs-0_local_part_0", media(1))
	var buf [16]*Encoder
	if a := testing.AllocsPerRun(100, func() { r.p.placement(c, buf[:0]) }); a != 0 {
		t.Errorf("placement by content allocates %.0f times", a)
	}
}

func TestAffinityValidateNamesTheField(t *testing.T) {
	ok := func(mut func(*AffinityConfig)) error {
		c := DefaultAffinity()
		mut(&c)
		var p configfile.Problems
		c.Validate(&p, "affinity")
		return p.Err()
	}
	if err := ok(func(*AffinityConfig) {}); err != nil {
		t.Fatalf("the defaults: %v", err)
	}
	d := DefaultAffinity()
	if d.EncodeBy != EncodeByReqID || d.LoadFactor != 1.25 || d.MetadataCache != 65536 {
		t.Errorf("defaults: encode_by %q load_factor %g metadata_cache %d, want req_id, 1.25 and 65536",
			d.EncodeBy, d.LoadFactor, d.MetadataCache)
	}
	for _, good := range []func(*AffinityConfig){
		func(c *AffinityConfig) { c.EncodeBy = EncodeByContent },
		func(c *AffinityConfig) { c.LoadFactor = 10 },
		func(c *AffinityConfig) { c.LoadFactor = 1.01 },
		func(c *AffinityConfig) { c.MetadataCache = 0 },
	} {
		if err := ok(good); err != nil {
			t.Errorf("refused: %v", err)
		}
	}
	for _, c := range []struct {
		mut  func(*AffinityConfig)
		want string
	}{
		{func(c *AffinityConfig) { c.EncodeBy = "" }, `affinity.encode_by: must be req_id or content, got ""`},
		{func(c *AffinityConfig) { c.EncodeBy = "mm_items" }, `affinity.encode_by: must be req_id or content, got "mm_items"`},
		{func(c *AffinityConfig) { c.LoadFactor = 1 }, "affinity.load_factor: must be > 1.0 and <= 10, got 1"},
		{func(c *AffinityConfig) { c.LoadFactor = 0 }, "affinity.load_factor: must be > 1.0 and <= 10, got 0"},
		{func(c *AffinityConfig) { c.LoadFactor = 10.5 }, "affinity.load_factor: must be > 1.0 and <= 10, got 10.5"},
		{func(c *AffinityConfig) { c.LoadFactor = math.NaN() }, "affinity.load_factor: must be > 1.0 and <= 10, got NaN"},
		{func(c *AffinityConfig) { c.MetadataCache = -1 }, "affinity.metadata_cache: must be >= 0 (0 disables sharing), got -1"},
	} {
		err := ok(c.mut)
		if err == nil || err.Error() != c.want {
			t.Errorf("got %v, want %s", err, c.want)
		}
	}
}
