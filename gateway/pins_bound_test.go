package gateway

import (
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/encgate/encgate/fakeencoder"
	"github.com/encgate/encgate/internal/configfile"
	"github.com/encgate/encgate/upstream"
)

// pinsWatcher gathers encgate_pins from g's registry over and over until
// stopped, and keeps the highest value it saw.
type pinsWatcher struct {
	stop atomic.Bool
	done chan struct{}
	peak atomic.Int64
	errs atomic.Int64
}

func watchPins(g *gw) *pinsWatcher {
	w := &pinsWatcher{done: make(chan struct{})}
	go func() {
		defer close(w.done)
		for !w.stop.Load() {
			mfs, err := g.reg.Gather()
			if err != nil {
				w.errs.Add(1)
				continue
			}
			for _, mf := range mfs {
				if mf.GetName() == "encgate_pins" {
					if v := int64(mf.GetMetric()[0].GetGauge().GetValue()); v > w.peak.Load() {
						w.peak.Store(v)
					}
				}
			}
		}
	}()
	return w
}

func (w *pinsWatcher) finish(t *testing.T) int64 {
	t.Helper()
	w.stop.Store(true)
	<-w.done
	if w.errs.Load() > 0 {
		t.Fatalf("%d gathers of the registry failed", w.errs.Load())
	}
	return w.peak.Load()
}

// The operator's case (issue 25): affinity.max_pins 64; one part encoded,
// then 300 /encodes the gateway refuses with 400 before forwarding, then
// 100 it refuses with 503 (no usable encoder). None takes or evicts a pin:
// the encoded pin stays, encgate_pins never passes 64 (it stays at 1), and
// the part's metadata pull goes straight to the encoder that encoded it,
// without waiting affinity.unknown_wait (an hour here, so a wait would hang
// the pull; a watcher fails the test as soon as the pull waits). Then 300
// /encodes that the encoders answer 400 themselves: their failed pins fill
// the table and make room for each other, failed pins going first, and the
// encoded pin still stays.
func TestRefusedEncodesNeverTakeOrEvictAPin(t *testing.T) {
	const bound = 64
	encs := startFakes(t, 3, nil)
	g := startGateway(t, fakeURLs(encs), func(c *Config) {
		c.Health.Disabled = true
		c.Affinity.MaxPins = bound
		c.Affinity.UnknownWait = configfile.Duration(time.Hour)
	})
	pins := g.Pool()
	watch := watchPins(g)
	const kept = "kept_local_part_0"
	enc := post(t, g.base+"/encode", encodeBody(kept))
	if enc.status != 200 {
		t.Fatalf("/encode: %d %s", enc.status, enc.body)
	}
	holder := enc.header.Get("X-Encgate-Encoder")
	if pin, ok := pins.LocalPin(kept); !ok || pin.State != upstream.PinEncoded || pin.Encoder != holder {
		t.Fatalf("pin after the /encode: %+v %v, want encoded on %s", pin, ok, holder)
	}
	encodes := func() int64 { return routesSeen(encs)["/encode"] }

	// 300 bodies refused with 400, each its own req_id.
	for i := 0; i < 300; i++ {
		id := fmt.Sprintf("bad-%d_local_part_0", i)
		bad := strings.Replace(encodeBody(id), `"num_parts":1`, `"num_parts":0`, 1)
		wantEnvelopeMsg(t, post(t, g.base+"/encode", bad), http.StatusBadRequest, "num_parts must be a positive integer", strp(id))
		if n := pins.PinsHeld(); n != 1 {
			t.Fatalf("after refused /encode %d: %d pins, want the encoded one alone", i+1, n)
		}
	}
	// 100 refused with 503: no encoder is usable.
	for _, e := range g.Pool().Encoders() {
		e.SetUsable(false)
	}
	for i := 0; i < 100; i++ {
		id := fmt.Sprintf("none-%d_local_part_0", i)
		wantEnvelopeMsg(t, post(t, g.base+"/encode", encodeBody(id)), http.StatusServiceUnavailable, "encgate: no usable encoder", strp(id))
		if n := pins.PinsHeld(); n != 1 {
			t.Fatalf("after /encode %d with no usable encoder: %d pins, want the encoded one alone", i+1, n)
		}
	}
	for _, e := range g.Pool().Encoders() {
		e.SetUsable(true)
	}
	if n := encodes(); n != 1 {
		t.Fatalf("the encoders received %d /encodes, want the good one alone", n)
	}
	if _, ok := pins.LocalPin("bad-0_local_part_0"); ok {
		t.Fatal("a refused /encode left a pin")
	}
	if pin, ok := pins.LocalPin(kept); !ok || pin.State != upstream.PinEncoded {
		t.Fatalf("the encoded pin after 400 refusals: %+v %v", pin, ok)
	}
	if pins.PinEvictionsTotal() != 0 {
		t.Fatalf("%d pins evicted by refusals", pins.PinEvictionsTotal())
	}
	t.Logf("after 400 refused /encodes: %d pins, %d evictions, encgate_pins peak %d", pins.PinsHeld(), pins.PinEvictionsTotal(), watch.peak.Load())

	// 300 /encodes the encoders answer 400 themselves, 8 at a time: each
	// places a pin (pending, then failed), so the table reaches its bound.
	for _, e := range encs {
		e.SetFaults(fakeencoder.Faults{FailureRate: 1, FailStatus: 400, FailMessage: "Error while loading data x", FailRoutes: []string{"/encode"}})
	}
	var wg sync.WaitGroup
	var over atomic.Int64
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < 300; i += 8 {
				id := fmt.Sprintf("failed-%d_local_part_0", i)
				if a := post(t, g.base+"/encode", encodeBody(id)); a.status != http.StatusBadRequest {
					t.Errorf("/encode %s: %d %s, want the encoder's 400", id, a.status, a.body)
				}
				if n := int64(pins.PinsHeld()); n > bound {
					over.Store(n)
				}
			}
		}()
	}
	wg.Wait()
	for _, e := range encs {
		e.SetFaults(fakeencoder.Faults{})
	}
	if n := over.Load(); n > 0 {
		t.Fatalf("%d pins held, above max_pins %d", n, bound)
	}
	if pin, ok := pins.LocalPin(kept); !ok || pin.State != upstream.PinEncoded || pin.Encoder != holder {
		t.Fatalf("the encoded pin after 300 failed /encodes: %+v %v", pin, ok)
	}
	// 1 + 300 pins into 64 slots, nothing expiring or released: 237 made
	// room, every one a failed pin.
	if f, p, e := pins.PinEvictions(upstream.PinFailed), pins.PinEvictions(upstream.PinPending), pins.PinEvictions(upstream.PinEncoded); f != 237 || p != 0 || e != 0 {
		t.Fatalf("evictions: failed %d, pending %d, encoded %d; want 237 failed alone", f, p, e)
	}
	if v := seriesValue(t, g, "encgate_pin_evictions_total", "state", "failed"); v != 237 {
		t.Fatalf("encgate_pin_evictions_total{state=failed} = %v, want 237", v)
	}

	// The part's metadata pull: straight to its encoder.
	got := make(chan answer, 1)
	go func() { got <- post(t, g.base+routeMetadata, metaBody(kept)) }()
	var meta answer
wait:
	for {
		select {
		case meta = <-got:
			break wait
		default:
			if pins.PinWaiters() != 0 {
				t.Fatal("the metadata pull waits for a pin: the encoded pin was lost")
			}
			time.Sleep(time.Millisecond) // polls Waiting, which offers no signal
		}
	}
	if meta.status != 200 || meta.header.Get("X-Encgate-Encoder") != holder {
		t.Fatalf("metadata pull: %d from %q %s, want 200 from %s", meta.status, meta.header.Get("X-Encgate-Encoder"), meta.body, holder)
	}
	for _, e := range encs {
		st := e.Stats()
		want := int64(0)
		if st.Name == holder {
			want = 1
		}
		if n := st.ReqIDs[kept][routeMetadata]; n != want {
			t.Fatalf("%s received %d metadata pulls for %s, want %d", st.Name, n, kept, want)
		}
	}
	peak := watch.finish(t)
	if peak > bound {
		t.Fatalf("encgate_pins reached %d, above max_pins %d", peak, bound)
	}
	t.Logf("after 300 answered failures: %d pins (bound %d, encgate_pins peak %d); evictions failed %d, pending %d, encoded %d; the pull answered by %s",
		pins.PinsHeld(), bound, peak, pins.PinEvictions(upstream.PinFailed), pins.PinEvictions(upstream.PinPending), pins.PinEvictions(upstream.PinEncoded), holder)
}
