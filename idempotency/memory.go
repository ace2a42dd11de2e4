package idempotency

import (
	"context"
	"math"
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
// Bounds: capacity counts records (one per destination), per shard
// (capacity/64+1 each). The req_id just written is never the one evicted,
// so one req_id's own destinations are bounded separately: at most
// maxDests = min(capacity, max_destinations_per_req_id), done and in flight
// together, checked by Claim before anything is forwarded. Each record's
// strings are bounded by the parser (limits.max_field_bytes), its body by
// upstream.max_response_bytes.
//
// It does not track who holds a claim: Sends coalesces callers in process.
// It counts, per req_id, the claims on destinations not yet recorded, so
// that concurrent new destinations cannot pass the bound together.
type Memory struct {
	clk      clock.Clock
	ttl      int64
	perShard int    // records per shard
	maxDests int    // destinations per req_id, done and claimed
	bound    string // the config key that sets maxDests
	shards   [memShards]memShard

	records   atomic.Int64
	evictions atomic.Int64
}

type memShard struct {
	mu      sync.Mutex // protects every field below and the entries
	reqs    map[string]*reqEntry
	head    *reqEntry // least recently active, first to expire
	tail    *reqEntry
	records int
	// claims counts, per req_id, the claims Claim granted on destinations
	// without a record that have not ended yet (Complete or Abandon).
	claims map[string]int32
	// index places each destination of a req_id with more than linearDests
	// of them in its more slice, so a lookup stays O(1) however many there
	// are. Real req_ids (one destination per TP rank) never get one and pay
	// nothing for it: a short scan is faster than a map and costs no memory.
	index map[*reqEntry]map[string]int32
}

// linearDests is the most destinations a req_id's lookup scans one by one
// (receiver TP <= 16); past it the shard indexes them.
const linearDests = 16

type reqEntry struct {
	reqID        string
	expires      int64
	receiveCount int32 // the latest positive receive_count seen (admin view)
	released     bool
	ndests       int32 // records held
	counted      int32 // destinations whose /send carried a receive_count
	prev, next   *reqEntry
	first        destRecord    // the first destination lives inline and the
	more         *[]destRecord // rest behind a pointer: 128 bytes per req_id
}

// destRecord is a Record packed for a million-entry store.
type destRecord struct {
	dest    string
	body    []byte // shares one "null" across records; never modified
	fp      Fingerprint
	status  uint16
	ctype   uint8 // index into contentTypes
	enc     uint8 // index into encoderNames: in the struct's padding, free
	counted bool  // counted toward release (a /send with receive_count > 0)
}

// interned is a small table of strings that records name by a one-byte
// index: a million records share a few distinct content types and encoder
// names. Index 0 is fixed at creation.
type interned struct {
	mu    sync.RWMutex
	names []string
}

// index returns name's index, adding it while there is room; a name that
// does not fit is given fallback's index.
func (t *interned) index(name, fallback string) uint8 {
	t.mu.RLock()
	for i, n := range t.names {
		if n == name {
			t.mu.RUnlock()
			return uint8(i)
		}
	}
	t.mu.RUnlock()
	t.mu.Lock()
	defer t.mu.Unlock()
	for i, n := range t.names {
		if n == name {
			return uint8(i)
		}
	}
	if len(t.names) < 256 {
		t.names = append(t.names, strings.Clone(name))
		return uint8(len(t.names) - 1)
	}
	for i, n := range t.names {
		if n == fallback {
			return uint8(i)
		}
	}
	return 0
}

func (t *interned) name(i uint8) string {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return t.names[i]
}

var (
	// contentTypes are the content types encoders answer with; index 0 is
	// "none". An unseen type past 255 is stored as
	// application/octet-stream (never reached by sglang's encoders).
	contentTypes = &interned{names: []string{"", "application/json", "text/plain; charset=utf-8", "application/octet-stream"}}
	// encoderNames are the encoders that answered; index 0 is "unknown".
	// Names come from the config, so there are few; past 255 a record keeps
	// no name (its replay then names no encoder).
	encoderNames = &interned{names: []string{""}}
)

var nullBody = []byte("null")

func pack(dest string, r *Record) destRecord {
	body := r.Body
	if string(body) == "null" {
		body = nullBody
	}
	return destRecord{dest: dest, body: body, fp: r.FP, status: uint16(r.Status), ctype: contentTypes.index(r.ContentType, "application/octet-stream"),
		enc: encoderNames.index(r.Encoder, "")}
}

func (d *destRecord) record() Record {
	return Record{Status: int(d.status), ContentType: contentTypes.name(d.ctype), Body: d.body, FP: d.fp, Encoder: encoderNames.name(d.enc)}
}

var _ Store = (*Memory)(nil)

// NewMemory returns a store holding up to capacity records for ttl each,
// and up to min(capacity, maxDests) destinations per req_id.
func NewMemory(capacity, maxDests int, ttl time.Duration, clk clock.Clock) *Memory {
	m := &Memory{clk: clk, ttl: int64(ttl), perShard: capacity/memShards + 1,
		maxDests: maxDests, bound: "idempotency.max_destinations_per_req_id"}
	if capacity < maxDests {
		m.maxDests, m.bound = capacity, "idempotency.capacity"
	}
	m.maxDests = max(m.maxDests, 1)
	for i := range m.shards {
		m.shards[i].reqs = make(map[string]*reqEntry)
		m.shards[i].claims = make(map[string]int32)
		m.shards[i].index = make(map[*reqEntry]map[string]int32)
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

// find returns e's record for dest, or nil. s.mu is held.
func (s *memShard) find(e *reqEntry, dest string) *destRecord {
	if e.ndests == 0 {
		return nil
	}
	if e.first.dest == dest {
		return &e.first
	}
	if e.more == nil {
		return nil
	}
	more := *e.more
	if e.ndests > linearDests {
		if i, ok := s.index[e][dest]; ok {
			return &more[i]
		}
		return nil
	}
	for i := range more {
		if more[i].dest == dest {
			return &more[i]
		}
	}
	return nil
}

// add stores d as a new destination of e and returns where it went. s.mu
// is held.
func (s *memShard) add(e *reqEntry, d destRecord) *destRecord {
	e.ndests++
	switch {
	case e.ndests == 1:
		e.first = d
		return &e.first
	case e.more == nil:
		e.more = &[]destRecord{d}
	default:
		*e.more = append(*e.more, d)
	}
	more := *e.more
	if e.ndests > linearDests {
		idx := s.index[e]
		if idx == nil {
			idx = make(map[string]int32, 2*len(more))
			for i := range more {
				idx[more[i].dest] = int32(i)
			}
			s.index[e] = idx
		} else {
			idx[d.dest] = int32(len(more) - 1)
		}
	}
	return &more[len(more)-1]
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

// endClaim ends one of reqID's claims on a destination without a record.
// s.mu is held.
func (s *memShard) endClaim(reqID string) {
	switch n := s.claims[reqID]; {
	case n > 1:
		s.claims[reqID] = n - 1
	case n == 1:
		delete(s.claims, reqID)
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
	if d := s.find(e, k.Dest); d != nil {
		return d.record(), true, false, nil
	}
	return Record{}, false, e.released, nil
}

// Claim implements Store. In process there is never another holder; a
// claim on a destination without a record counts toward the req_id's bound
// until Complete or Abandon.
func (m *Memory) Claim(_ context.Context, k Key, _ Fingerprint) (Claim, error) {
	s := m.shard(k.ReqID)
	s.mu.Lock()
	defer s.mu.Unlock()
	have := 0
	if e := m.live(s, k.ReqID, m.clk.Now().UnixNano()); e != nil {
		if d := s.find(e, k.Dest); d != nil {
			rec := d.record()
			return Claim{State: StateRecorded, Record: &rec}, nil
		}
		if e.released {
			return Claim{State: StateReleased}, nil
		}
		have = int(e.ndests)
	}
	n := s.claims[k.ReqID]
	if have+int(n) >= m.maxDests {
		return Claim{}, &DestinationLimitError{ReqID: k.ReqID, Dest: k.Dest, Limit: m.maxDests, Bound: m.bound}
	}
	s.claims[k.ReqID] = n + 1
	return Claim{State: StateClaimed}, nil
}

// Complete implements Store. A record is stored even past the destination
// bound (a Complete without a Claim): the /send has been made, and its
// record is what keeps it from being made again.
func (m *Memory) Complete(_ context.Context, k Key, rec *Record, receiveCount int) (bool, error) {
	now := m.clk.Now().UnixNano()
	s := m.shard(k.ReqID)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.endClaim(k.ReqID)
	e := m.live(s, k.ReqID, now)
	fresh := e == nil
	if fresh {
		e = &reqEntry{reqID: k.ReqID}
		s.reqs[e.reqID] = e
	} else {
		s.unlink(e)
	}
	e.expires = now + m.ttl
	s.append(e)
	d := s.find(e, k.Dest)
	if d == nil {
		dest := k.Dest // a new req_id keeps the key's shared allocation (NewKey)
		if !fresh {
			dest = strings.Clone(dest) // do not pin another copy of the req_id
		}
		d = s.add(e, pack(dest, rec))
		s.records++
		m.records.Add(1)
	}
	// sglang's note_send_done: this call's own receive_count against the
	// distinct destinations counted so far (see Store).
	if receiveCount > 0 {
		e.receiveCount = int32(min(receiveCount, math.MaxInt32))
		if !d.counted {
			d.counted = true
			e.counted++
		}
		if int(e.counted) >= receiveCount {
			e.released = true
		}
	}
	m.makeRoom(s)
	return e.released, nil
}

// Abandon implements Store: the claim no longer counts toward the bound.
func (m *Memory) Abandon(_ context.Context, k Key) error {
	s := m.shard(k.ReqID)
	s.mu.Lock()
	s.endClaim(k.ReqID)
	s.mu.Unlock()
	return nil
}

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
	if e.ndests > linearDests {
		delete(s.index, e)
	}
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
