package idempotency

import (
	"context"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/encgate/encgate/internal/clock"
)

const memShards = 64

// Memory is the in-process store: bounded, with a TTL, safe for concurrent
// use. A req_id's records live together (sglang's TP ranks send the same
// req_id to several destinations), in shards keyed by req_id; each shard
// keeps its req_ids on a list ordered by last activity, which with one TTL is
// expiry order, so the sweep and the size bound both take from its front.
//
// It does not track in-flight claims: Sends coalesces those in process.
type Memory struct {
	clk      clock.Clock
	ttl      int64
	perShard int // records per shard
	shards   [memShards]memShard

	records   atomic.Int64
	evictions atomic.Int64
}

type memShard struct {
	mu      sync.Mutex // protects reqs, list and records
	reqs    map[string]*reqEntry
	head    *reqEntry // least recently active, first to expire
	tail    *reqEntry
	records int
}

type reqEntry struct {
	reqID        string
	expires      int64
	receiveCount int32
	released     bool
	ndests       int32
	prev, next   *reqEntry
	first        destRecord    // the first destination lives inline and the
	more         *[]destRecord // rest behind a pointer: 128 bytes per req_id
}

// destRecord is a Record packed for a million-entry store.
type destRecord struct {
	dest   string
	body   []byte // shares one "null" across records; never modified
	fp     Fingerprint
	status uint16
	ctype  uint8 // index into contentTypes
}

// contentTypes interns the content types encoders answer with; index 0 is
// "none". An unseen type is added while there is room, else stored as
// application/octet-stream (never reached by sglang's encoders).
var (
	ctMu         sync.RWMutex
	contentTypes = []string{"", "application/json", "text/plain; charset=utf-8"}
)

func internType(ct string) uint8 {
	ctMu.RLock()
	for i, t := range contentTypes {
		if t == ct {
			ctMu.RUnlock()
			return uint8(i)
		}
	}
	ctMu.RUnlock()
	ctMu.Lock()
	defer ctMu.Unlock()
	if len(contentTypes) < 255 {
		contentTypes = append(contentTypes, strings.Clone(ct))
		return uint8(len(contentTypes) - 1)
	}
	return internType("application/octet-stream")
}

func typeName(i uint8) string {
	ctMu.RLock()
	defer ctMu.RUnlock()
	return contentTypes[i]
}

var nullBody = []byte("null")

func pack(dest string, r *Record) destRecord {
	body := r.Body
	if string(body) == "null" {
		body = nullBody
	}
	return destRecord{dest: dest, body: body, fp: r.FP, status: uint16(r.Status), ctype: internType(r.ContentType)}
}

func (d *destRecord) record() Record {
	return Record{Status: int(d.status), ContentType: typeName(d.ctype), Body: d.body, FP: d.fp}
}

var _ Store = (*Memory)(nil)

// NewMemory returns a store holding up to capacity records for ttl each.
func NewMemory(capacity int, ttl time.Duration, clk clock.Clock) *Memory {
	m := &Memory{clk: clk, ttl: int64(ttl), perShard: capacity/memShards + 1}
	for i := range m.shards {
		m.shards[i].reqs = make(map[string]*reqEntry)
	}
	return m
}

func (m *Memory) shard(reqID string) *memShard {
	return &m.shards[xxhash.Sum64String(reqID)%memShards]
}

// live returns reqID's entry if present and not expired. s.mu is held.
func (m *Memory) live(s *memShard, reqID string, now int64) *reqEntry {
	e := s.reqs[reqID]
	if e == nil {
		return nil
	}
	if e.expires <= now {
		m.drop(s, e, false)
		return nil
	}
	return e
}

func (e *reqEntry) find(dest string) *destRecord {
	if e.ndests > 0 && e.first.dest == dest {
		return &e.first
	}
	if e.more != nil {
		for i := range *e.more {
			if (*e.more)[i].dest == dest {
				return &(*e.more)[i]
			}
		}
	}
	return nil
}

func (e *reqEntry) add(d destRecord) {
	switch {
	case e.ndests == 0:
		e.first = d
	case e.more == nil:
		e.more = &[]destRecord{d}
	default:
		*e.more = append(*e.more, d)
	}
	e.ndests++
}

func (e *reqEntry) each(f func(*destRecord)) {
	if e.ndests > 0 {
		f(&e.first)
	}
	if e.more != nil {
		for i := range *e.more {
			f(&(*e.more)[i])
		}
	}
}

// Lookup implements Store.
func (m *Memory) Lookup(_ context.Context, k Key) (Record, bool, bool, error) {
	s := m.shard(k.ReqID)
	s.mu.Lock()
	defer s.mu.Unlock()
	e := m.live(s, k.ReqID, m.clk.Now().UnixNano())
	if e == nil {
		return Record{}, false, false, nil
	}
	if d := e.find(k.Dest); d != nil {
		return d.record(), true, false, nil
	}
	return Record{}, false, e.released, nil
}

// Claim implements Store. In process there is never another holder.
func (m *Memory) Claim(ctx context.Context, k Key, _ Fingerprint) (Claim, error) {
	rec, found, released, _ := m.Lookup(ctx, k)
	switch {
	case found:
		return Claim{State: StateRecorded, Record: &rec}, nil
	case released:
		return Claim{State: StateReleased}, nil
	default:
		return Claim{State: StateClaimed}, nil
	}
}

// Complete implements Store.
func (m *Memory) Complete(_ context.Context, k Key, rec *Record, receiveCount int) (bool, error) {
	now := m.clk.Now().UnixNano()
	s := m.shard(k.ReqID)
	s.mu.Lock()
	defer s.mu.Unlock()
	e := m.live(s, k.ReqID, now)
	dest := k.Dest // a new req_id keeps the key's shared allocation (NewKey)
	if e == nil {
		e = &reqEntry{reqID: k.ReqID}
		s.reqs[e.reqID] = e
	} else {
		dest = strings.Clone(dest) // do not pin another copy of the req_id
		s.unlink(e)
	}
	e.expires = now + m.ttl
	s.append(e)
	if receiveCount > 0 && e.receiveCount == 0 {
		e.receiveCount = int32(receiveCount)
	}
	if e.find(k.Dest) == nil {
		e.add(pack(dest, rec))
		s.records++
		m.records.Add(1)
	}
	if e.receiveCount > 0 && int(e.ndests) >= int(e.receiveCount) {
		e.released = true
	}
	m.makeRoom(s)
	return e.released, nil
}

// Abandon implements Store; there is no claim to end in process.
func (m *Memory) Abandon(context.Context, Key) error { return nil }

// Await implements Store; in process there is never another holder.
func (m *Memory) Await(context.Context, Key) (*Record, bool, error) { return nil, false, nil }

// Inspect implements Store.
func (m *Memory) Inspect(_ context.Context, reqID string) (ReqView, error) {
	v := ReqView{ReqID: reqID}
	s := m.shard(reqID)
	s.mu.Lock()
	defer s.mu.Unlock()
	e := m.live(s, reqID, m.clk.Now().UnixNano())
	if e == nil {
		return v, nil
	}
	v.ReceiveCount, v.Released, v.Done = int(e.receiveCount), e.released, int(e.ndests)
	e.each(func(d *destRecord) {
		v.Destinations = append(v.Destinations, DestView{Dest: d.dest, State: "done", Status: int(d.status)})
	})
	sort.Slice(v.Destinations, func(i, j int) bool { return v.Destinations[i].Dest < v.Destinations[j].Dest })
	return v, nil
}

// Records returns the number of records held.
func (m *Memory) Records() int64 { return m.records.Load() }

// Evictions returns the number of live records dropped for the bound.
func (m *Memory) Evictions() int64 { return m.evictions.Load() }

// Sweep drops expired req_ids and returns how many records went.
func (m *Memory) Sweep() int {
	now := m.clk.Now().UnixNano()
	n := 0
	for i := range m.shards {
		s := &m.shards[i]
		s.mu.Lock()
		for s.head != nil && s.head.expires <= now {
			n += int(s.head.ndests)
			m.drop(s, s.head, false)
		}
		s.mu.Unlock()
	}
	return n
}

// makeRoom evicts the req_ids nearest to expiry while the shard is over
// its bound. s.mu is held.
func (m *Memory) makeRoom(s *memShard) {
	for s.records > m.perShard && s.head != nil && s.head != s.tail {
		m.drop(s, s.head, true)
	}
}

func (m *Memory) drop(s *memShard, e *reqEntry, evicted bool) {
	s.unlink(e)
	delete(s.reqs, e.reqID)
	s.records -= int(e.ndests)
	m.records.Add(-int64(e.ndests))
	if evicted {
		m.evictions.Add(int64(e.ndests))
	}
}

func (s *memShard) append(e *reqEntry) {
	e.prev, e.next = s.tail, nil
	if s.tail != nil {
		s.tail.next = e
	} else {
		s.head = e
	}
	s.tail = e
}

func (s *memShard) unlink(e *reqEntry) {
	if e.prev != nil {
		e.prev.next = e.next
	} else if s.head == e {
		s.head = e.next
	}
	if e.next != nil {
		e.next.prev = e.prev
	} else if s.tail == e {
		s.tail = e.prev
	}
	e.prev, e.next = nil, nil
}

// Run sweeps expired records every ttl/10 until ctx ends.
func (m *Memory) Run(ctx context.Context) {
	every := time.Duration(m.ttl / 10)
	for {
		t := m.clk.NewTimer(every)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C():
			m.Sweep()
		}
	}
}
