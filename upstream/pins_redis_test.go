package upstream

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/redistest"
)

// sharedTables is n replicas' pin tables sharing one Redis, each
// subscribed to the placements before it is returned.
func sharedTables(t *testing.T, n int) []*PinTable {
	t.Helper()
	srv := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr(), DisableIdentity: true})
	t.Cleanup(func() { _ = c.Close() })
	return sharedTablesOn(t, c, []*redis.Client{c}, n)
}

// sharedTablesOn is sharedTables over client, whose servers are nodes (a
// cluster's masters: each counts only its own subscribers).
func sharedTablesOn(t *testing.T, client redis.UniversalClient, nodes []*redis.Client, n int) []*PinTable {
	t.Helper()
	out := make([]*PinTable, n)
	for i := range out {
		out[i] = NewPinTable(time.Minute, 1000, clock.Real{})
		ctx, cancel := context.WithCancel(context.Background())
		done := out[i].Share(ctx, NewRedisPins(client, "t:", time.Minute, time.Second, time.Hour, nil, nil), nil)
		t.Cleanup(func() { cancel(); <-done })
	}
	for {
		var subs int64
		for _, node := range nodes {
			m, err := node.PubSubNumSub(context.Background(), "t:pins:placed").Result()
			if err != nil {
				t.Fatal(err)
			}
			subs += m["t:pins:placed"]
		}
		if subs == int64(n) {
			return out
		}
		time.Sleep(time.Millisecond) // Redis offers no signal for a subscription made on another connection
	}
}

// The share applies PinTable's rules across replicas: one placement wins,
// a move follows only a pending pin on its encoder, an encoded pin is not
// failed, and every replica reads the pin in force.
func TestSharedPinsFollowOneRule(t *testing.T) { testSharedPinsFollowOneRule(t, sharedTables(t, 3)) }

func testSharedPinsFollowOneRule(t *testing.T, tables []*PinTable) {
	a, b, fresh := tables[0], tables[1], tables[2]
	if p, placed := a.Place("r", "enc-1", 1); !placed || p.Encoder != "enc-1" || p.Remote {
		t.Fatalf("first placement: %+v %v", p, placed)
	}
	// A sibling /encode on the other replica follows the first placement.
	if p, placed := b.Place("r", "enc-2", 2); placed || p.Encoder != "enc-1" || !p.Remote {
		t.Fatalf("sibling on b: %+v placed %v, want to follow enc-1", p, placed)
	}
	// b moves nothing that is not pending on the encoder it names.
	if b.Move("r", 2, "enc-3", 3) {
		t.Fatal("a move from the wrong encoder was applied")
	}
	if !a.Move("r", 1, "enc-3", 3) {
		t.Fatal("a's move from its own placement was refused")
	}
	// b had the old pin: a retry reads the move.
	if p, ok := b.Current("r"); !ok || p.Encoder != "enc-3" {
		t.Fatalf("b after the move: %+v %v", p, ok)
	}
	a.Encoded("r", 3)
	b.Fail("r", Failure{Status: 500, Message: "late", Answered: true})
	if p, ok := fresh.Get("r"); !ok || p.State != PinEncoded || p.Encoder != "enc-3" {
		t.Fatalf("a fresh replica reads %+v %v, want encoded on enc-3", p, ok)
	}
	// A failed part is placed afresh.
	b.Fail("f", Failure{Status: 400, Message: "bad", Answered: true, Placed: true})
	if p, ok := a.Get("f"); !ok || !p.Failed() || p.Message != "bad" || p.Status != 400 {
		t.Fatalf("a reads the failure as %+v %v", p, ok)
	}
	if p, placed := a.Place("f", "enc-1", 1); !placed || p.Failed() {
		t.Fatalf("a new /encode of a failed part: %+v %v", p, placed)
	}
	// The gateway's own failure of an /encode that holds no pin is stored
	// nowhere: not in b's table, not in Redis.
	b.Fail("g", Failure{Status: 503, Message: "encgate: no usable encoder"})
	if p, ok := fresh.Get("g"); ok || b.Len() != 2 {
		t.Fatalf("a gateway failure without pin: a fresh replica reads %+v %v; b holds %d pins, want 2", p, ok, b.Len())
	}
	// The encoder's own answer is shared, on the encoder that answered.
	b.Fail("h", Failure{Status: 500, Message: "boom", Answered: true, Encoder: "enc-2", EncoderID: 2})
	if p, ok := fresh.Get("h"); !ok || !p.Failed() || p.Encoder != "enc-2" || p.EncoderID != 2 {
		t.Fatalf("an answered failure without pin reads %+v %v", p, ok)
	}
}

// A follow-up waiting on one replica is woken by the placement on the
// other through pub/sub (the poll here is an hour), not by its wait.
func TestSharedPinWakesAWaiter(t *testing.T) { testSharedPinWakesAWaiter(t, sharedTables(t, 2), "w") }

func testSharedPinWakesAWaiter(t *testing.T, tables []*PinTable, reqID string) {
	a, b := tables[0], tables[1]
	got := make(chan Pin, 1)
	go func() {
		p, _ := b.Wait(reqID, time.Hour, nil)
		got <- p
	}()
	for b.Waiting() == 0 {
		time.Sleep(time.Millisecond) // b has no signal to offer before it waits
	}
	a.Place(reqID, "enc-1", 1)
	select {
	case p := <-got:
		if p.Encoder != "enc-1" {
			t.Fatalf("woken with %+v", p)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the waiter was not woken by the placement")
	}
}

// gatedShare is a PinShare whose Get counts its calls and answers each
// with the next of answers once the test lets it go (gate); Run hands the
// test the placement callback.
type gatedShare struct {
	gets   chan struct{} // one value per Get, as it starts
	gate   chan bool     // the answer of each Get: found or not
	placed chan func(string)
	pin    Pin
}

func (g *gatedShare) Place(string, Pin) (Pin, bool, error) { return Pin{}, false, errors.New("unused") }
func (g *gatedShare) Move(string, uint64, Pin) (Pin, bool, error) {
	return Pin{}, false, errors.New("unused")
}
func (g *gatedShare) Encoded(string, uint64) error                 { return errors.New("unused") }
func (g *gatedShare) Fail(string, Failure) error                   { return errors.New("unused") }
func (g *gatedShare) Poll() time.Duration                          { return time.Hour }
func (g *gatedShare) Run(ctx context.Context, placed func(string)) { g.placed <- placed; <-ctx.Done() }
func (g *gatedShare) Get(string) (Pin, bool, error) {
	g.gets <- struct{}{}
	select {
	case found := <-g.gate:
		if found {
			return g.pin, true, nil
		}
		return Pin{}, false, nil
	case <-time.After(10 * time.Second): // a read the test never lets go: it fails, not hangs
		return Pin{}, false, errors.New("gatedShare: read never let go")
	}
}

func gatedTable(t *testing.T) (*PinTable, *gatedShare, func(string)) {
	t.Helper()
	g := &gatedShare{gets: make(chan struct{}, 64), gate: make(chan bool), placed: make(chan func(string), 1),
		pin: Pin{Encoder: "enc-1", EncoderID: 1, State: PinEncoded}}
	tab := NewPinTable(time.Minute, 1000, clock.Real{})
	ctx, cancel := context.WithCancel(context.Background())
	done := tab.Share(ctx, g, nil)
	t.Cleanup(func() { cancel(); <-done })
	return tab, g, <-g.placed
}

// waiters is how many goroutines wait for reqID's pin in tab.
func waiters(tab *PinTable, reqID string) int {
	s := tab.shard(reqID)
	s.mu.Lock()
	defer s.mu.Unlock()
	if w := s.waiting[reqID]; w != nil {
		return w.n
	}
	return 0
}

// Follow-ups of one req_id that arrive together on a replica without its
// pin read the share once between them.
func TestPinWaitersShareOneRead(t *testing.T) {
	tab, g, _ := gatedTable(t)
	const n = 8
	got := make(chan Pin, n)
	for range n {
		go func() {
			p, _ := tab.Wait("r", time.Hour, nil)
			got <- p
		}()
	}
	<-g.gets // the first waiter's read is in flight
	for waiters(tab, "r") < n {
		time.Sleep(time.Millisecond) // the others offer no signal before they wait
	}
	if extra := len(g.gets); extra != 0 {
		t.Fatalf("%d waiters read the share: want 1 read for all", extra+1)
	}
	g.gate <- true
	for range n {
		if p := <-got; p.Encoder != "enc-1" {
			t.Fatalf("a waiter got %+v", p)
		}
	}
	if extra := len(g.gets); extra != 0 {
		t.Fatalf("%d more reads of the share once the pin was found", extra)
	}
}

// A placement message that comes while the waiters' read is in flight
// (that read may have reached Redis before the placement) makes it read
// once more when it found nothing: the waiter gets the pin without
// waiting for a poll (an hour here).
func TestPinPlacementDuringAReadReadsAgain(t *testing.T) {
	tab, g, placed := gatedTable(t)
	got := make(chan Pin, 1)
	go func() {
		p, _ := tab.Wait("r", time.Hour, nil)
		got <- p
	}()
	<-g.gets
	placed("r") // returns at once: the read in flight goes again
	select {
	case <-g.gets:
		t.Fatal("the placement message read the share while a read was in flight")
	default:
	}
	g.gate <- false // the first read found no pin
	<-g.gets        // so it reads again
	g.gate <- true
	if p := <-got; p.Encoder != "enc-1" {
		t.Fatalf("the waiter got %+v", p)
	}
}
