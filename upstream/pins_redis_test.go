package upstream

import (
	"context"
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
