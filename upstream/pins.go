package upstream

import (
	"context"
	"math"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
)

// PinState is where a req_id's /encode stands.
type PinState uint8

// Pin states.
const (
	// PinPending: the /encode was placed on the encoder and has not ended.
	PinPending PinState = iota
	// PinEncoded: the /encode was answered 200. Nothing later overwrites it
	// but a newer placement (NewPending after the pin expired).
	PinEncoded
	// PinFailed: the /encode ended in a non-200; Status and Message are the
	// answer its follow-ups get.
	PinFailed
)

// Pin is what the gateway remembers about one req_id: the encoder its
// /encode went to, how that /encode stands and, when it failed, the answer,
// so follow-ups can get the same status and message at once.
type Pin struct {
	Encoder string // empty when the gateway failed the /encode before choosing one
	// EncoderID identifies the encoder's name and URL at pin time: a reload
	// that moves a name to another URL must not send its pins there.
	EncoderID uint64
	State     PinState
	// Answered: the failure is the encoder's own answer, so the encoder
	// holds (or held) the part's state.
	Answered bool
	Status   int
	Message  string
	// Remote: the pin came from the share (another replica placed or
	// changed it), not from this process's own placement.
	Remote bool
}

// Failed reports whether the req_id's /encode failed.
func (p Pin) Failed() bool { return p.State == PinFailed }

const pinShards = 64

// pinClass orders the pins for eviction at affinity.max_pins: a failed pin
// goes before a pending one, a pending one before an encoded one. A failed
// pin only answers follow-ups at once; a pending one is an /encode still
// going, whose follow-ups would lose their encoder; an encoded one is a part
// an encoder holds.
type pinClass uint8

const (
	classFailed pinClass = iota
	classPending
	classEncoded
	pinClasses
)

func classOf(s PinState) pinClass {
	switch s {
	case PinFailed:
		return classFailed
	case PinEncoded:
		return classEncoded
	}
	return classPending
}

// PinTable maps req_id to Pin with a TTL and a size bound. It is safe for
// concurrent use. Follow-ups that arrive before their /encode can Wait for
// the pin.
//
// The bound is exact and global: the table never holds more than max pins
// (Len counts every pin held, expired ones not yet swept included, and the
// slots reserved by stores under way). A new req_id reserves its slot with
// a compare-and-swap on the count; at the bound it first makes room (see
// makeRoom): an expired pin, else the oldest failed pin, else the oldest
// pending, else the oldest encoded. Each of the 64 shards keeps its pins on
// one list per class in the order of their last write, which is the order
// they expire in, since every write gives a pin the same TTL.
type PinTable struct {
	clk    clock.Clock
	ttl    time.Duration
	max    int64
	shards [pinShards]pinShard
	share  PinShare    // nil: this process alone
	log    *zap.Logger // the share's failures

	count     atomic.Int64 // pins held plus slots reserved; never above max
	evictions [pinClasses]atomic.Int64
}

type pinShard struct {
	mu sync.Mutex // protects everything below
	m  map[string]int32
	// e holds the entries m points into; free slots are chained through
	// next from free (-1: none).
	e       []pinEntry
	free    int32
	lists   [pinClasses]pinList
	waiting map[string]*pinWaiters
	// heads mirrors, for makeRoom's scan without the lock, each list's
	// head's expiry (noHead when the list is empty). Written under mu.
	heads [pinClasses]atomic.Int64
}

const noHead = math.MaxInt64

// pinList is one class's entries of a shard, oldest write first, linked
// through pinEntry.prev and next (slot indices; -1 ends).
type pinList struct{ head, tail int32 }

type pinEntry struct {
	key        string
	pin        Pin
	expires    int64 // unix nanoseconds
	prev, next int32
	class      pinClass
}

type pinWaiters struct {
	ch chan struct{} // closed when the req_id is pinned or failed
	n  int           // waiting on ch, or with a function in fns
	// fns are WaitFunc's, run (each on a goroutine of its own) when ch
	// is closed.
	fns []func()
	// reading: a read of the share for these waiters is in flight (see
	// readFor); again: a placement message came meanwhile, so that read
	// goes once more if it finds no pin.
	reading, again bool
	// poll reads the share again every Poll while they wait (armPoll):
	// one timer and one read per req_id, however many wait for it.
	poll clock.Timer
}

// NewPinTable returns a table holding up to bound pins (at least one) for
// ttl each.
func NewPinTable(ttl time.Duration, bound int, clk clock.Clock) *PinTable {
	t := &PinTable{clk: clk, ttl: ttl, max: int64(max(bound, 1))}
	for i := range t.shards {
		s := &t.shards[i]
		s.m = make(map[string]int32)
		s.waiting = make(map[string]*pinWaiters)
		s.free = -1
		for c := range s.lists {
			s.lists[c] = pinList{-1, -1}
			s.heads[c].Store(noHead)
		}
	}
	return t
}

func (t *PinTable) shard(reqID string) *pinShard {
	return &t.shards[xxhash.Sum64String(reqID)%pinShards]
}

// Set pins reqID to the encoder named encoder with identity id (see
// Encoder.ID) as pending, replacing any earlier pin or failure.
func (t *PinTable) Set(reqID, encoder string, id uint64) {
	t.update(reqID, func(Pin, bool) (Pin, bool) { return Pin{Encoder: encoder, EncoderID: id}, true })
}

// Place pins reqID to encoder as pending unless it already has a live pin
// that is pending or encoded: then that pin is returned and placed is false
// (the /encode is a sibling's, and follows it). A failed pin is replaced:
// a new /encode of a failed part is tried afresh.
//
// With a share, a live local pin that is not failed answers at once;
// otherwise the share decides, so that sibling /encodes on other replicas
// follow one placement, and the table keeps what it decided. A share that
// fails leaves the decision to this table.
func (t *PinTable) Place(reqID, encoder string, id uint64) (pin Pin, placed bool) {
	if t.share != nil {
		if cur, ok := t.Local(reqID); ok && !cur.Failed() {
			return cur, false
		}
		want := Pin{Encoder: encoder, EncoderID: id}
		cur, placed, err := t.share.Place(reqID, want)
		if err == nil {
			return t.adopt(reqID, want, cur, placed), placed
		}
		t.shareFailed("place", reqID, err)
	}
	return t.placeLocal(reqID, encoder, id)
}

// adopt stores what the share decided: want when this call changed the
// shared pin, else the shared pin (marked remote), and returns it.
func (t *PinTable) adopt(reqID string, want, cur Pin, changed bool) Pin {
	p := want
	if !changed {
		p = cur
		p.Remote = true
	}
	t.update(reqID, func(Pin, bool) (Pin, bool) { return p, true })
	return p
}

func (t *PinTable) shareFailed(op, reqID string, err error) {
	t.log.Warn("the pins shared through Redis failed; this replica decides from its own table",
		zap.String("op", op), zap.String("req_id", reqID), zap.Error(err))
}

func (t *PinTable) placeLocal(reqID, encoder string, id uint64) (pin Pin, placed bool) {
	t.update(reqID, func(cur Pin, ok bool) (Pin, bool) {
		if ok && !cur.Failed() {
			pin, placed = cur, false
			return cur, false
		}
		pin, placed = Pin{Encoder: encoder, EncoderID: id}, true
		return pin, true
	})
	return pin, placed
}

// Move re-pins a pending reqID from the encoder with identity from to
// encoder, for an /encode retried on the next encoder because nothing
// reached the first. It reports false, changing nothing, when the pin is no
// longer pending on from (a sibling's /encode settled or moved it).
func (t *PinTable) Move(reqID string, from uint64, encoder string, id uint64) bool {
	if t.share != nil {
		want := Pin{Encoder: encoder, EncoderID: id}
		cur, moved, err := t.share.Move(reqID, from, want)
		if err == nil {
			if moved || cur.State != PinPending || cur.EncoderID != from {
				t.adopt(reqID, want, cur, moved)
			}
			return moved
		}
		t.shareFailed("move", reqID, err)
	}
	moved := false
	t.update(reqID, func(cur Pin, ok bool) (Pin, bool) {
		if !ok || cur.State != PinPending || cur.EncoderID != from {
			moved = false
			return cur, false
		}
		moved = true
		return Pin{Encoder: encoder, EncoderID: id}, true
	})
	return moved
}

// Encoded records that reqID's /encode on the encoder with identity id was
// answered 200. A pin that names another encoder is left as it is.
func (t *PinTable) Encoded(reqID string, id uint64) {
	if t.share != nil {
		if err := t.share.Encoded(reqID, id); err != nil {
			t.shareFailed("encoded", reqID, err)
		}
	}
	t.update(reqID, func(cur Pin, ok bool) (Pin, bool) {
		if !ok || cur.EncoderID != id || cur.Encoder == "" {
			return cur, false
		}
		return Pin{Encoder: cur.Encoder, EncoderID: id, State: PinEncoded}, true
	})
}

// Failure is how an /encode failed, for Fail.
type Failure struct {
	Status  int
	Message string
	// Answered: the encoder itself answered so.
	Answered bool
	// Consequence: the answer is a consequence of another failure of the
	// part (GEN0's "Encode failed on the first request" to a sibling rank).
	Consequence bool
	// Placed: this call placed the pin (ranked strategy); a call that
	// followed another's pin did not.
	Placed bool
	// Encoder and EncoderID name the encoder that answered, when Answered.
	Encoder   string
	EncoderID uint64
}

// Fail records that reqID's /encode ended in f. The encoder it was pinned
// to, if any, is kept. Where reqID has no live pin, only the encoder's own
// answer is recorded (a pin dropped while its /encode ran), on the encoder
// that answered: a failure the gateway made itself never takes a slot of
// the bound, so it never evicts a pin. Three pins are left as they are,
// because the failure says nothing about the part they hold:
//   - a pin whose /encode was answered 200: the encoder still holds the part;
//   - an earlier failure, when f is a consequence of it: it would only hide
//     the cause;
//   - a pending pin another call placed, when the gateway answered f itself:
//     that call's /encode is still going (a sibling rank refused at the
//     gateway, say, while the first rank's encode runs).
func (t *PinTable) Fail(reqID string, f Failure) {
	if t.share != nil {
		if err := t.share.Fail(reqID, f); err != nil {
			t.shareFailed("fail", reqID, err)
		}
	}
	t.update(reqID, func(cur Pin, ok bool) (Pin, bool) {
		if !ok && !f.Answered || ok && (cur.State == PinEncoded || cur.Failed() && f.Consequence ||
			cur.State == PinPending && !f.Answered && !f.Placed) {
			return cur, false
		}
		if !ok {
			cur = Pin{Encoder: f.Encoder, EncoderID: f.EncoderID}
		}
		return Pin{Encoder: cur.Encoder, EncoderID: cur.EncoderID, State: PinFailed,
			Answered: f.Answered, Status: f.Status, Message: f.Message}, true
	})
}

// update applies f to reqID's live pin (ok false when there is none) under
// the shard's lock, storing what it returns when store is true.
//
// A store for a req_id the shard does not hold needs a slot of the bound.
// When none is free, update lets go of the shard's lock, makes room (which
// locks other shards, one at a time) and runs f again on what the shard
// then holds: f must set all it reports on every run.
func (t *PinTable) update(reqID string, f func(cur Pin, ok bool) (next Pin, store bool)) {
	s := t.shard(reqID)
	for {
		s.mu.Lock()
		// Read under the lock: a shard's lists stay in the order of the
		// writes' times.
		now := t.clk.Now().UnixNano()
		i, exists := s.m[reqID]
		var cur Pin
		live := exists && s.e[i].expires > now
		if live {
			cur = s.e[i].pin
		}
		next, store := f(cur, live)
		switch {
		case !store:
		case exists:
			t.rewriteLocked(s, i, next, now)
		case t.reserve():
			t.insertLocked(s, reqID, next, now)
		default:
			s.mu.Unlock()
			// Another store may take the slot makeRoom frees first; the
			// next run then makes room again.
			t.makeRoom()
			continue
		}
		s.mu.Unlock()
		return
	}
}

// reserve takes one slot of the bound, if one is free.
func (t *PinTable) reserve() bool {
	for {
		n := t.count.Load()
		if n >= t.max {
			return false
		}
		if t.count.CompareAndSwap(n, n+1) {
			return true
		}
	}
}

// insertLocked stores p for reqID in a slot already reserved and wakes its
// waiters; s.mu is held.
func (t *PinTable) insertLocked(s *pinShard, reqID string, p Pin, now int64) {
	i := s.free
	if i >= 0 {
		s.free = s.e[i].next
	} else {
		i = int32(len(s.e))
		s.e = append(s.e, pinEntry{})
	}
	s.e[i] = pinEntry{key: reqID, pin: p, expires: now + int64(t.ttl)}
	s.m[reqID] = i
	s.link(i, classOf(p.State))
	s.wake(reqID)
}

// rewriteLocked stores p over entry i, which becomes its class's newest,
// and wakes its waiters; s.mu is held.
func (t *PinTable) rewriteLocked(s *pinShard, i int32, p Pin, now int64) {
	s.unlink(i)
	e := &s.e[i]
	e.pin, e.expires = p, now+int64(t.ttl)
	s.link(i, classOf(p.State))
	s.wake(e.key)
}

// removeLocked drops entry i and gives back its slot of the bound; s.mu is
// held.
func (t *PinTable) removeLocked(s *pinShard, i int32) {
	s.unlink(i)
	delete(s.m, s.e[i].key)
	s.e[i] = pinEntry{next: s.free} // lets go of the strings
	s.free = i
	t.count.Add(-1)
}

func (s *pinShard) wake(reqID string) {
	if w := s.waiting[reqID]; w != nil {
		close(w.ch)
		for _, f := range w.fns {
			go f()
		}
		delete(s.waiting, reqID)
		w.stopPoll()
	}
}

// leave takes one waiter off w (its wait ended without the pin: deadline,
// done or stop); the last one takes w out of waiting. s.mu is held.
func (s *pinShard) leave(reqID string, w *pinWaiters) {
	if w.n--; w.n == 0 && s.waiting[reqID] == w {
		delete(s.waiting, reqID)
		w.stopPoll()
	}
}

// stopPoll stops w's poll, once w is out of waiting; the shard's mu is
// held. A poll already running finds w gone and does not arm again.
func (w *pinWaiters) stopPoll() {
	if w.poll != nil {
		w.poll.Stop()
		w.poll = nil
	}
}

// registerLocked adds a waiter for reqID's pin (s.mu is held), with the
// req_id's poll armed, and says whether that waiter reads the share itself
// once s.mu is let go. That is decided in the lock that registers it: a
// read in flight when it registers serves it too, even if that read ends
// before the waiter runs on (see readFor).
func (t *PinTable) registerLocked(s *pinShard, reqID string) (w *pinWaiters, read bool) {
	w = s.waiting[reqID]
	if w == nil {
		w = &pinWaiters{ch: make(chan struct{})}
		s.waiting[reqID] = w
	}
	w.n++
	t.armPoll(s, reqID, w)
	read = t.share != nil && !w.reading
	w.reading = w.reading || read
	return w, read
}

// armPoll arms w's poll if it has none, when the table has a share; s.mu
// is held. Each Poll, while w waits, the share is read for all of w's
// waiters at once (readFor: a pin found is stored, which wakes them), so
// that a placement message lost to a reconnect is made up for: with
// thousands of pulls waiting in a 504 storm, one read per req_id, not one
// per pull.
func (t *PinTable) armPoll(s *pinShard, reqID string, w *pinWaiters) {
	if t.share == nil || w.poll != nil {
		return
	}
	w.poll = t.clk.AfterFunc(t.share.Poll(), func() {
		s.mu.Lock()
		waits := s.waiting[reqID] == w
		s.mu.Unlock()
		if !waits {
			return
		}
		t.readFor(s, reqID, w, false)
		s.mu.Lock()
		if s.waiting[reqID] == w {
			w.poll = nil
			t.armPoll(s, reqID, w)
		}
		s.mu.Unlock()
	})
}

// link appends entry i to class c's list.
func (s *pinShard) link(i int32, c pinClass) {
	l := &s.lists[c]
	e := &s.e[i]
	e.class, e.prev, e.next = c, l.tail, -1
	if l.tail >= 0 {
		s.e[l.tail].next = i
	} else {
		l.head = i
		s.heads[c].Store(e.expires)
	}
	l.tail = i
}

// unlink takes entry i off its class's list.
func (s *pinShard) unlink(i int32) {
	e := &s.e[i]
	l := &s.lists[e.class]
	if e.prev >= 0 {
		s.e[e.prev].next = e.next
	} else {
		l.head = e.next
		h := int64(noHead)
		if e.next >= 0 {
			h = s.e[e.next].expires
		}
		s.heads[e.class].Store(h)
	}
	if e.next >= 0 {
		s.e[e.next].prev = e.prev
	} else {
		l.tail = e.prev
	}
	e.prev, e.next = -1, -1
}

// victim is a list head makeRoom may drop.
type victim struct {
	shard   int
	expires int64
	class   pinClass
	expired bool
}

// before reports whether v goes before w: an expired pin first (the one
// that expired first), then by class, then the oldest.
func (v *victim) before(w *victim) bool {
	if w.shard < 0 || v.expired != w.expired {
		return w.shard < 0 || v.expired
	}
	if !v.expired && v.class != w.class {
		return v.class < w.class
	}
	return v.expires < w.expires
}

// makeRoom drops one pin while the table is at its bound: the first of
// every shard's list heads by victim.before, so an expired pin (not
// counted as an eviction), else the oldest failed pin, else the oldest
// pending one, else the oldest encoded one. It reads the heads' expiries
// without a lock (pinShard.heads), then locks the chosen shard alone and
// drops that list's head if it is still the one it read, else looks
// again: it never holds two shards' locks.
func (t *PinTable) makeRoom() {
	for t.count.Load() >= t.max {
		now := t.clk.Now().UnixNano()
		best := victim{shard: -1}
		for si := range t.shards {
			s := &t.shards[si]
			for c := range s.heads {
				if exp := s.heads[c].Load(); exp != noHead {
					v := victim{shard: si, expires: exp, class: pinClass(c), expired: exp <= now}
					if v.before(&best) {
						best = v
					}
				}
			}
		}
		if best.shard < 0 {
			// Every slot is reserved by a store under way: it is about to
			// insert, and its pin can then make room.
			runtime.Gosched()
			continue
		}
		s := &t.shards[best.shard]
		s.mu.Lock()
		if h := s.lists[best.class].head; h >= 0 && s.e[h].expires == best.expires {
			t.removeLocked(s, h)
			if !best.expired {
				t.evictions[best.class].Add(1)
			}
			s.mu.Unlock()
			return
		}
		s.mu.Unlock()
	}
}

// Get returns reqID's pin if it has one that has not expired: this
// table's, else the share's (kept here from then on).
func (t *PinTable) Get(reqID string) (Pin, bool) {
	if p, ok := t.Local(reqID); ok || t.share == nil {
		return p, ok
	}
	return t.fetch(reqID)
}

// Current is Get, except that a pin another replica placed that is still
// pending is read again from the share: a retry must follow that /encode
// if it moved to the next encoder.
func (t *PinTable) Current(reqID string) (Pin, bool) {
	p, ok := t.Local(reqID)
	if t.share == nil || ok && !(p.Remote && p.State == PinPending) {
		return p, ok
	}
	if q, found := t.fetch(reqID); found {
		return q, true
	}
	return p, ok
}

// fetch reads reqID's pin from the share and keeps it, unless this table
// has one by then.
func (t *PinTable) fetch(reqID string) (Pin, bool) {
	p, ok, err := t.share.Get(reqID)
	if err != nil {
		t.shareFailed("get", reqID, err)
		return Pin{}, false
	}
	if !ok {
		return Pin{}, false
	}
	p.Remote = true
	var kept Pin
	t.update(reqID, func(cur Pin, live bool) (Pin, bool) {
		if live && !(cur.Remote && cur != p) {
			kept = cur
			return cur, false
		}
		kept = p
		return p, true
	})
	return kept, true
}

// Local returns this table's pin for reqID, never asking the share.
func (t *PinTable) Local(reqID string) (Pin, bool) {
	return t.LocalAt(reqID, t.clk.Now())
}

// LocalAt is Local at now, a time the caller read from the table's clock
// already (a request's start).
func (t *PinTable) LocalAt(reqID string, at time.Time) (Pin, bool) {
	now := at.UnixNano()
	s := t.shard(reqID)
	s.mu.Lock()
	defer s.mu.Unlock()
	i, ok := s.m[reqID]
	if !ok || s.e[i].expires <= now {
		return Pin{}, false
	}
	return s.e[i].pin, true
}

// WaitFunc is Wait with nothing waiting: a parked follow-up's
// (ExchangeParked). It reports true, and registers nothing, when Wait
// would not wait (reqID has a live pin here, or d <= 0); the caller then
// goes on (calling Wait). Otherwise fn runs once, on a goroutine of its
// own, when reqID is pinned or failed here, d has passed on the injected
// clock, or stop (when not nil) ends, as Wait's done does; fn then reads
// the pin (Wait with d 0).
//
// With a share, it waits as Wait does, with no goroutine of its own: the
// share is read once the waiter is registered (on the caller's goroutine,
// one read shared by the waiters that arrive together, see readFor), a
// placement message wakes it, and the req_id's poll (armPoll, one for all
// its waiters) reads the share again every Poll while it waits, on the
// timer's goroutine.
func (t *PinTable) WaitFunc(reqID string, d time.Duration, stop context.Context, fn func()) (now bool) {
	if _, ok := t.Local(reqID); ok || d <= 0 {
		return true
	}
	s := t.shard(reqID)
	s.mu.Lock()
	if i, ok := s.m[reqID]; ok && s.e[i].expires > t.clk.Now().UnixNano() {
		s.mu.Unlock()
		return true
	}
	w, read := t.registerLocked(s, reqID)
	fw := &funcWait{}
	w.fns = append(w.fns, func() { // the pin came (wake)
		if fw.fire() {
			fn()
		}
	})
	gaveUp := func() { // the deadline passed, or stop ended
		if !fw.fire() {
			return
		}
		s.mu.Lock()
		s.leave(reqID, w)
		s.mu.Unlock()
		fn()
	}
	fw.mu.Lock() // gaveUp may run before AfterFunc returns
	fw.timer = t.clk.AfterFunc(d, gaveUp)
	if stop != nil {
		fw.stop = context.AfterFunc(stop, gaveUp)
	}
	fw.mu.Unlock()
	s.mu.Unlock()
	if read {
		t.readLoop(s, reqID, w) // stores a pin it finds, which wakes w
	}
	return false
}

// funcWait is one WaitFunc registration's state: fired once, by the pin
// (a placement message or its req_id's poll may bring it), the deadline or
// the caller's stop, and what it armed, which fire stops.
type funcWait struct {
	mu    sync.Mutex
	fired bool
	timer clock.Timer // the deadline's
	stop  func() bool // its registration on the caller's stop, if any
}

// fire reports whether this is the registration's first end, and stops
// its timers if so.
func (fw *funcWait) fire() bool {
	fw.mu.Lock()
	defer fw.mu.Unlock()
	if fw.fired {
		return false
	}
	fw.fired = true
	if fw.timer != nil {
		fw.timer.Stop()
	}
	if fw.stop != nil {
		fw.stop()
	}
	return true
}

// Wait returns reqID's pin, waiting up to d for one to be set. It gives up
// early when done is closed. ok is false when no pin came.
//
// With a share, the share is read once the waiter is registered (so that
// a placement published after that read wakes it; waiters of one req_id
// that arrive while such a read is in flight share it, see readFor), then
// on every message of the share's placement channel for reqID and every
// Poll (one read per req_id for all its waiters, armPoll): a pin another
// replica wrote is found at once, never after d.
func (t *PinTable) Wait(reqID string, d time.Duration, done <-chan struct{}) (Pin, bool) {
	if p, ok := t.Local(reqID); ok || d <= 0 {
		if ok || t.share == nil {
			return p, ok
		}
		return t.fetch(reqID)
	}
	s := t.shard(reqID)
	s.mu.Lock()
	if i, ok := s.m[reqID]; ok && s.e[i].expires > t.clk.Now().UnixNano() {
		p := s.e[i].pin
		s.mu.Unlock()
		return p, true
	}
	w, read := t.registerLocked(s, reqID)
	s.mu.Unlock()
	if read {
		t.readLoop(s, reqID, w) // stores a pin it finds, which closes w.ch
	}

	// Pub/sub wakes this waiter when another replica places the pin
	// (Share); the req_id's poll (armPoll) covers a message lost to a
	// reconnect.
	timer := t.clk.NewTimer(d)
	select {
	case <-w.ch:
	case <-timer.C():
	case <-done:
	}
	timer.Stop()

	s.mu.Lock()
	s.leave(reqID, w)
	s.mu.Unlock()
	return t.Local(reqID)
}

// Share makes t share its pins through s from now on (call it before any
// traffic) and runs s's subscription until ctx ends: a req_id placed on
// another replica wakes this replica's follow-ups waiting for it.
func (t *PinTable) Share(ctx context.Context, s PinShare, log *zap.Logger) (done <-chan struct{}) {
	if log == nil {
		log = zap.NewNop()
	}
	t.share, t.log = s, log
	ch := make(chan struct{})
	go func() {
		defer close(ch)
		s.Run(ctx, t.placedElsewhere)
	}()
	return ch
}

// placedElsewhere reads reqID's pin, just placed on another replica, for
// the follow-ups here that wait for it, if any.
func (t *PinTable) placedElsewhere(reqID string) {
	s := t.shard(reqID)
	s.mu.Lock()
	w := s.waiting[reqID]
	s.mu.Unlock()
	if w != nil {
		t.readFor(s, reqID, w, true)
	}
}

// readFor reads reqID's pin from the share for the follow-ups w waiting
// for it, one read at a time; a pin found is stored, which wakes them. So
// follow-ups of one req_id that arrive together on a replica without its
// pin read Redis once between them, not once each. A waiter that arrives
// while a read is in flight needs no read of its own: a pin placed before
// that read reached Redis is in its answer, and one placed after is
// published after, so its message comes while the waiters still wait. Such
// a message (placed) coming while the read is in flight makes the read go
// once more when it found no pin. The waiters' polls read on their own.
func (t *PinTable) readFor(s *pinShard, reqID string, w *pinWaiters, placed bool) {
	s.mu.Lock()
	if w.reading {
		w.again = w.again || placed
		s.mu.Unlock()
		return
	}
	w.reading = true
	s.mu.Unlock()
	t.readLoop(s, reqID, w)
}

// readLoop is readFor's reading, once w.reading is set for it.
func (t *PinTable) readLoop(s *pinShard, reqID string, w *pinWaiters) {
	for {
		t.fetch(reqID)
		s.mu.Lock()
		// A stored pin took w out of waiting (and woke it).
		if !w.again || s.waiting[reqID] != w {
			w.reading, w.again = false, false
			s.mu.Unlock()
			return
		}
		w.again = false
		s.mu.Unlock()
	}
}

// Delete forgets reqID.
func (t *PinTable) Delete(reqID string) {
	s := t.shard(reqID)
	s.mu.Lock()
	if i, ok := s.m[reqID]; ok {
		t.removeLocked(s, i)
	}
	s.mu.Unlock()
}

// Len returns the number of pins held, expired ones not yet swept included,
// and of slots reserved by stores under way: never more than the bound.
func (t *PinTable) Len() int { return int(t.count.Load()) }

// Evictions returns how many live pins were dropped to respect the bound.
func (t *PinTable) Evictions() int64 {
	var n int64
	for c := range t.evictions {
		n += t.evictions[c].Load()
	}
	return n
}

// EvictionsOf returns how many live pins in state st were dropped to
// respect the bound.
func (t *PinTable) EvictionsOf(st PinState) int64 { return t.evictions[classOf(st)].Load() }

// Waiting returns how many req_ids have follow-ups waiting for a pin.
func (t *PinTable) Waiting() int {
	n := 0
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.Lock()
		n += len(s.waiting)
		s.mu.Unlock()
	}
	return n
}

// Sweep removes expired pins and returns how many it removed.
func (t *PinTable) Sweep() int {
	now := t.clk.Now().UnixNano()
	n := 0
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.Lock()
		n += t.sweepShard(s, now)
		s.mu.Unlock()
	}
	return n
}

// sweepShard drops the shard's expired entries: the heads of its lists,
// which are in expiry order.
func (t *PinTable) sweepShard(s *pinShard, now int64) int {
	n := 0
	for c := range s.lists {
		for h := s.lists[c].head; h >= 0 && s.e[h].expires <= now; h = s.lists[c].head {
			t.removeLocked(s, h)
			n++
		}
	}
	return n
}

// CountByEncoder returns the number of live pins per encoder name. It walks
// the whole table, so it is for the admin API, not the request path.
func (t *PinTable) CountByEncoder() map[string]int {
	now := t.clk.Now().UnixNano()
	out := map[string]int{}
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.Lock()
		for _, i := range s.m {
			if e := &s.e[i]; e.expires > now && e.pin.Encoder != "" {
				out[e.pin.Encoder]++
			}
		}
		s.mu.Unlock()
	}
	return out
}

// Holding counts, for each encoder identity in ids, the live pins that still
// need that encoder: pending or encoded ones (a failed pin is answered from
// the table, without the encoder). It walks the whole table, so it is for
// the fleet's drain check, which calls it only while an encoder drains.
func (t *PinTable) Holding(ids map[uint64]int) {
	if len(ids) == 0 {
		return
	}
	now := t.clk.Now().UnixNano()
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.Lock()
		for _, i := range s.m {
			if e := &s.e[i]; e.expires > now && !e.pin.Failed() && e.pin.Encoder != "" {
				if n, ok := ids[e.pin.EncoderID]; ok {
					ids[e.pin.EncoderID] = n + 1
				}
			}
		}
		s.mu.Unlock()
	}
}
