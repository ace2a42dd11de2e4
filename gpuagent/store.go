package gpuagent

import (
	"bytes"
	"cmp"
	"errors"
	"slices"
	"sync"
	"time"
)

// entry is one staged req_id: an embedding, or a failed encode's message.
type entry struct {
	id     string
	tokens int64
	dim    int64
	dtype  string
	elem   int64
	nbytes int64 // bytes held (0 for a failed encode)
	source string
	// device says the bytes are in device memory (source=cuda): they count
	// against the device's cuda.capacity_bytes, not staging.capacity_bytes.
	device bool
	failed string // non-empty: the encode failed with this message
	at     time.Time
	owner  stager // the process that staged it: only it may stage its ack frame

	// ready is closed once the bytes are in place (or staging failed); mem
	// and reg are written before that and only read after it.
	ready chan struct{}
	mem   region
	reg   string // regShared or regPerSend

	// Guarded by store.mu.
	aborted  bool                // staging failed: there never were bytes
	released bool                // out of the map; freed when users reaches 0
	users    int                 // the stager and /sends using the memory
	dests    map[string]struct{} // distinct prefill_host:embedding_port done
	acked    map[string]struct{} // destinations an ack was sent (or is being sent) to
	receive  int64               // the latest receive_count seen

	pinMu sync.Mutex // protects pins and pinned
	pins  int        // sends in flight that need the per-send pin
	// pinned says the per-send registration succeeded and must be undone.
	pinned bool
}

// hostBytes is what e holds of staging.capacity_bytes.
func (e *entry) hostBytes() int64 {
	if e.device {
		return 0
	}
	return e.nbytes
}

// isReady reports whether staging finished (and so mem/reg may be read).
func (e *entry) isReady() bool {
	select {
	case <-e.ready:
		return true
	default:
		return false
	}
}

var (
	errExists   = errors.New("exists")
	errCapacity = errors.New("capacity")
)

// ownedError is a req_id another process staged first (its embedding, its
// failure or its ack frame): only that process may stage the rest.
type ownedError struct{ owner stager }

func (e *ownedError) Error() string { return "owned by " + e.owner.String() }

// ackFrame is the ack frame staged for a req_id. It is kept apart from the
// req_id's entry so that either may be staged first, and goes when that
// entry is released (or, staged for no entry, at the TTL sweep). data is
// never written after it is stored.
type ackFrame struct {
	data  []byte
	at    time.Time
	owner stager
}

// store holds the staged entries and ack frames and the bytes they take.
// An entry leaves the map when it is released (all destinations done, a send
// error, the TTL sweep, shutdown), and its ack frame with it; its memory is
// freed once no /send uses it anymore.
type store struct {
	capacity int64
	m        *metrics
	unpin    func([]byte) error // undoes a shared registration before unmapping

	mu      sync.Mutex           // protects entries, acks, held, count and entries' guarded fields
	entries map[string]*entry    // by req_id, released ones removed
	acks    map[string]*ackFrame // by req_id
	held    int64                // bytes of every entry not yet freed and of every ack frame
	count   int                  // entries not yet freed
}

func newStore(capacity int64, m *metrics, unpin func([]byte) error) *store {
	return &store{capacity: capacity, m: m, unpin: unpin, entries: map[string]*entry{}, acks: map[string]*ackFrame{}}
}

// putAck stages data as id's ack frame for owner. A req_id whose embedding
// or frame another process staged is an *ownedError, and nothing changes. A
// second frame for id is accepted when it is the same bytes (same reports
// that), errExists otherwise; errCapacity when it does not fit.
func (s *store) putAck(id string, data []byte, at time.Time, owner stager) (same bool, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if e, ok := s.entries[id]; ok && e.owner != owner {
		return false, &ownedError{owner: e.owner}
	}
	if old, ok := s.acks[id]; ok && old.owner != owner {
		return false, &ownedError{owner: old.owner}
	}
	if old, ok := s.acks[id]; ok {
		if bytes.Equal(old.data, data) {
			return true, nil
		}
		return false, errExists
	}
	if int64(len(data)) > s.capacity-s.held {
		return false, errCapacity
	}
	s.acks[id] = &ackFrame{data: data, at: at, owner: owner}
	s.held += int64(len(data))
	s.gauges()
	return false, nil
}

// ackFrame returns id's staged ack frame, or nil.
func (s *store) ackFrame(id string) []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	if a := s.acks[id]; a != nil {
		return a.data
	}
	return nil
}

// claimAck reports whether dest is the first destination of e to be acked
// as dest, and marks it so; a later /send to the same destination is not
// acked again (a second ack makes sglang's receiver fail the request).
func (s *store) claimAck(e *entry, dest string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, done := e.acked[dest]; done {
		return false
	}
	e.acked[dest] = struct{}{}
	return true
}

// dropAckLocked forgets id's ack frame, if any.
func (s *store) dropAckLocked(id string) {
	if a, ok := s.acks[id]; ok {
		delete(s.acks, id)
		s.held -= int64(len(a.data))
		s.gauges()
	}
}

// reserve adds e (not ready yet) and its bytes: an *ownedError when another
// process staged the req_id (or its ack frame), errExists when it is already
// staged, errCapacity when its bytes do not fit. The caller holds a use of e
// and ends it with commit or abort.
func (s *store) reserve(e *entry) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if old, ok := s.entries[e.id]; ok {
		if old.owner != e.owner {
			return &ownedError{owner: old.owner}
		}
		return errExists
	}
	if a, ok := s.acks[e.id]; ok && a.owner != e.owner {
		return &ownedError{owner: a.owner}
	}
	if e.hostBytes() > s.capacity-s.held {
		return errCapacity
	}
	e.ready = make(chan struct{})
	e.users = 1
	e.dests = map[string]struct{}{}
	e.acked = map[string]struct{}{}
	s.entries[e.id] = e
	s.held += e.hostBytes()
	s.count++
	s.gauges()
	return nil
}

// commit makes e ready with its memory and ends the stager's use.
func (s *store) commit(e *entry, mem region, reg string) {
	e.mem, e.reg = mem, reg
	s.mu.Lock()
	close(e.ready)
	s.mu.Unlock()
	s.done(e)
}

// abort drops e, whose staging failed, and ends the stager's use.
func (s *store) abort(e *entry) {
	s.mu.Lock()
	e.aborted = true
	s.releaseLocked(e)
	close(e.ready)
	s.mu.Unlock()
	s.done(e)
}

// acquire returns the entry for id with a use taken, or nil when none is
// staged. The caller must wait for ready and end the use with done.
func (s *store) acquire(id string) *entry {
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.entries[id]
	if e != nil {
		e.users++
	}
	return e
}

// live reports whether e is still staged (not released or aborted).
func (s *store) live(e *entry) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return !e.released && !e.aborted
}

// sent records a confirmed send to dest and releases e once receive
// distinct destinations are done (receive <= 0 leaves e to the sweep).
func (s *store) sent(e *entry, dest string, receive int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e.dests[dest] = struct{}{}
	if receive > 0 {
		e.receive = receive
		if int64(len(e.dests)) >= receive {
			s.releaseLocked(e)
		}
	}
}

// releaseID releases the entry for id, if one is staged.
func (s *store) releaseID(id string) {
	s.mu.Lock()
	e := s.entries[id]
	last := false
	if e != nil {
		s.releaseLocked(e)
		last = e.users == 0
	}
	s.mu.Unlock()
	if last {
		s.free(e)
	}
}

// release takes e out of the map (its memory goes once unused).
func (s *store) release(e *entry) {
	s.mu.Lock()
	s.releaseLocked(e)
	s.mu.Unlock()
}

// releaseLocked takes e out of the map, with its ack frame unless e's
// staging failed (the encoder may stage again for the same ack).
func (s *store) releaseLocked(e *entry) {
	if e.released {
		return
	}
	e.released = true
	if s.entries[e.id] == e {
		delete(s.entries, e.id)
		if !e.aborted {
			s.dropAckLocked(e.id)
		}
	}
}

// done ends one use of e and frees it when it was the last of a released e.
func (s *store) done(e *entry) {
	s.mu.Lock()
	e.users--
	last := e.released && e.users == 0
	s.mu.Unlock()
	if last {
		s.free(e)
	}
}

// free gives e's memory back. Only the last user of a released entry calls it.
func (s *store) free(e *entry) {
	if e.reg == regShared && e.mem.data != nil {
		_ = s.unpin(e.mem.data)
	}
	_ = e.mem.free()
	s.mu.Lock()
	s.held -= e.hostBytes()
	s.count--
	s.gauges()
	s.mu.Unlock()
}

// sweep releases every entry staged ttl or longer before now, and every
// ack frame staged that long ago for no entry, and returns how many of each
// it released.
func (s *store) sweep(now time.Time, ttl time.Duration) (entries, acks int) {
	return s.releaseWhere(func(at time.Time) bool { return now.Sub(at) >= ttl })
}

// releaseAll releases every entry and ack frame (shutdown).
func (s *store) releaseAll() (entries, acks int) {
	return s.releaseWhere(func(time.Time) bool { return true })
}

func (s *store) releaseWhere(match func(stagedAt time.Time) bool) (n, acks int) {
	var unused []*entry
	s.mu.Lock()
	for id, a := range s.acks {
		if s.entries[id] == nil && match(a.at) {
			s.dropAckLocked(id)
			acks++
		}
	}
	for _, e := range s.entries {
		if !match(e.at) {
			continue
		}
		s.releaseLocked(e)
		n++
		if e.users == 0 {
			unused = append(unused, e)
		}
	}
	s.mu.Unlock()
	for _, e := range unused {
		s.free(e)
	}
	return n, acks
}

func (s *store) gauges() {
	s.m.stagedBytes.Set(float64(s.held))
	s.m.stagedEntries.Set(float64(s.count))
}

// usage returns the bytes and entries held (for tests and the admin view).
func (s *store) usage() (held int64, count int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.held, s.count
}

// StagedEntry is one row of GET /admin/staged.
type StagedEntry struct {
	ReqID string `json:"req_id"`
	// State is staging (bytes still arriving), staged, failed (a failed
	// encode was recorded), or ack_only (an ack frame staged before its
	// embedding).
	State  string `json:"state"`
	Bytes  int64  `json:"bytes"`
	Tokens int64  `json:"tokens"`
	Dim    int64  `json:"dim"`
	Dtype  string `json:"dtype"`
	Source string `json:"source"` // body or fd; empty for a failed encode
	// StagedBy is the process that staged it (Unix socket peer credentials).
	StagedBy     string   `json:"staged_by"`
	Registration string   `json:"registration,omitempty"` // shared or per_send once staged
	Destinations []string `json:"destinations_done"`
	ReceiveCount int64    `json:"receive_count"` // 0 until a /send gave one
	Error        string   `json:"error,omitempty"`
	// AckFrame says an ack frame is staged for the req_id (POST /v1/ack);
	// AckFrameBytes is its size.
	AckFrame      bool     `json:"ack_frame"`
	AckFrameBytes int      `json:"ack_frame_bytes"`
	AcksSent      []string `json:"acks_sent"` // destinations acked (or being acked)
	SendsActive   int      `json:"sends_active"`
	AgeSeconds    float64  `json:"age_seconds"`
}

// snapshot lists the staged entries by req_id.
func (s *store) snapshot(now time.Time) []StagedEntry {
	s.mu.Lock()
	out := make([]StagedEntry, 0, len(s.entries))
	for _, e := range s.entries {
		row := StagedEntry{
			ReqID: e.id, State: "staged", Bytes: e.nbytes, Tokens: e.tokens, Dim: e.dim, Dtype: e.dtype,
			Source: e.source, Destinations: make([]string, 0, len(e.dests)), ReceiveCount: e.receive,
			Error: e.failed, SendsActive: e.users, AgeSeconds: now.Sub(e.at).Seconds(), StagedBy: e.owner.String(),
			AcksSent: make([]string, 0, len(e.acked)),
		}
		if a := s.acks[e.id]; a != nil {
			row.AckFrame, row.AckFrameBytes = true, len(a.data)
		}
		switch {
		case e.failed != "":
			row.State = "failed"
		case !e.isReady():
			row.State = "staging"
			row.SendsActive-- // the stager
		default:
			row.Registration = e.reg
		}
		for d := range e.dests {
			row.Destinations = append(row.Destinations, d)
		}
		slices.Sort(row.Destinations)
		for d := range e.acked {
			row.AcksSent = append(row.AcksSent, d)
		}
		slices.Sort(row.AcksSent)
		out = append(out, row)
	}
	for id, a := range s.acks {
		if s.entries[id] == nil {
			out = append(out, StagedEntry{ReqID: id, State: "ack_only", Destinations: []string{}, AcksSent: []string{}, StagedBy: a.owner.String(),
				AckFrame: true, AckFrameBytes: len(a.data), AgeSeconds: now.Sub(a.at).Seconds()})
		}
	}
	s.mu.Unlock()
	slices.SortFunc(out, func(a, b StagedEntry) int { return cmp.Compare(a.ReqID, b.ReqID) })
	return out
}
