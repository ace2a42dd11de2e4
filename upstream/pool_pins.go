package upstream

import (
	"context"

	"go.uber.org/zap"
)

// What the gateway asks of the pool's pins. The table itself stays inside
// the pool: the exchange is the only writer of placements, moves and
// outcomes, so no caller can break its rules.

// Pin is req_id's pin: this replica's, or, with the table shared (SharePins)
// and none here, the one another replica placed.
func (p *Pool) Pin(reqID string) (Pin, bool) { return p.pins.Get(reqID) }

// LocalPin is req_id's pin in this replica's table alone.
func (p *Pool) LocalPin(reqID string) (Pin, bool) { return p.pins.Local(reqID) }

// PinnedEncoder names the encoder that holds reqID, or "" for none; local
// reads this replica's table alone (Pin's answer, without Redis).
func (p *Pool) PinnedEncoder(reqID string, local bool) string {
	get := p.pins.Get
	if local {
		get = p.pins.Local
	}
	if pin, ok := get(reqID); ok {
		return pin.Encoder
	}
	return ""
}

// Unpin forgets reqID's pin: its part was released (its last /send
// answered), so no follow-up of it can come.
func (p *Pool) Unpin(reqID string) { p.pins.Delete(reqID) }

// SharePins shares the pins with other replicas through s until ctx ends;
// the channel closes once sharing has stopped (PinTable.Share).
func (p *Pool) SharePins(ctx context.Context, s PinShare, log *zap.Logger) <-chan struct{} {
	return p.pins.Share(ctx, s, log)
}

// PinsHeld is the number of pins this replica holds.
func (p *Pool) PinsHeld() int { return p.pins.Len() }

// PinWaiters is the number of follow-ups waiting for their req_id's pin.
func (p *Pool) PinWaiters() int { return p.pins.Waiting() }

// PinEvictions counts the pins of state st evicted to keep
// affinity.max_pins.
func (p *Pool) PinEvictions(st PinState) int64 { return p.pins.EvictionsOf(st) }

// PinEvictionsTotal counts the pins evicted to keep affinity.max_pins.
func (p *Pool) PinEvictionsTotal() int64 { return p.pins.Evictions() }

// PinsByEncoder counts the pins each encoder holds, by name.
func (p *Pool) PinsByEncoder() map[string]int { return p.pins.CountByEncoder() }

// PinTableForTest is the pool's table itself, for tests in other packages
// that write pins directly (a memory bound driven without sockets). Product
// code asks the methods above.
func (p *Pool) PinTableForTest() *PinTable { return p.pins }
