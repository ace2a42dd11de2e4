package discovery

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/encgate/encgate/internal/clock"
)

// stateVersion is the state file's format; a file of another version is
// not read (it is set aside as a corrupt one is).
const stateVersion = 1

// stateDoc is the state file: the memory store's live registrations when it
// was written. Times are on the store's clock. Tombstones are not kept:
// after a restart the registry serves only what the store lists, and
// nothing writes back a URL it does not list, so they would keep nothing
// out.
type stateDoc struct {
	Version  int          `json:"version"`
	SavedAt  time.Time    `json:"saved_at"`
	Encoders []stateEntry `json:"encoders"`
}

// stateEntry is one registration in the state file.
type stateEntry struct {
	URL          string     `json:"url"`
	RegisteredAt time.Time  `json:"registered_at"`
	ExpiresAt    time.Time  `json:"expires_at"`
	LastPassed   *time.Time `json:"last_passed,omitempty"` // absent: never passed a health check
}

// stateEntryBytes bounds one entry's encoding beside its URL, to bound the
// file that is read (max_encoders entries).
const stateEntryBytes = 256

// StateFile keeps a memory store's registrations in a file across gateway
// restarts (bootstrap.state_file): sglang's encoders register only once,
// so a gateway that forgot them on restart would serve none of them until
// they restarted too.
//
// The file is JSON: the live registrations (URL, registration time, expiry,
// last passed health check), at most max_encoders of them. It is written
// whole, atomically (a temporary file in the same directory, fsync, rename
// over the file, fsync of the directory), so a crash at any point leaves
// the previous state or the new one, never a mix; Run writes it on every
// change, at most once per state_write_interval, and Save at shutdown.
//
// At start (OpenStateFile) registrations whose expiry has passed are
// dropped: a gateway down longer than bootstrap.ttl comes back without
// them, as a Redis store would have let them expire. The registration and
// last-passed times of the others move on by the time since the file was
// written, so the downtime neither ends a new registration's grace nor
// makes a healthy encoder look failing (Room) before this process had the
// chance to check it.
type StateFile struct {
	path  string
	every time.Duration
	max   int
	store *memoryStore
	clk   clock.Clock
	log   *zap.Logger
	// writes counts the writes by result (ok, error); nil counts nothing.
	writes *prometheus.CounterVec

	mu sync.Mutex // serialises Save
	// write puts b in f, the temporary file; tests make it fail part way.
	write func(f *os.File, b []byte) error
}

// OpenStateFile reads cfg.StateFile into store, which must be a memory
// store that holds nothing yet, and returns the StateFile that keeps it
// there. A missing file is a first start: nothing to read. A file that
// cannot be read (permissions, an I/O error) is an error: the gateway does
// not start. A file that reads but does not decode as a state file (its
// bytes damaged or edited, another version, over the size bound) is logged
// at warn and renamed to StateFile+".corrupt", and the registry starts
// empty: the file only caches what encoders told the gateway, and a
// gateway that refused to start over it would serve nothing at all, not
// even its static encoders. Leftover temporary files of a write cut short
// are removed. reg (may be nil) receives encgate_bootstrap_state_writes_total.
func OpenStateFile(cfg BootstrapConfig, store Store, clk clock.Clock, log *zap.Logger, reg prometheus.Registerer) (*StateFile, error) {
	m, ok := store.(*memoryStore)
	if !ok {
		return nil, errors.New("bootstrap.state_file: only the memory store keeps its registrations in a file")
	}
	s := &StateFile{path: cfg.StateFile, every: cfg.StateWriteInterval.D(), max: cfg.MaxEncoders, store: m,
		clk: clk, log: log, write: func(f *os.File, b []byte) error { _, err := f.Write(b); return err }}
	if reg != nil {
		s.writes = registerOrReuse(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "encgate_bootstrap_state_writes_total",
			Help: "Writes of bootstrap.state_file, by result (ok, error); after an error the registrations since the last good write would be lost by a crash.",
		}, []string{"result"}))
		s.writes.WithLabelValues("ok")
		s.writes.WithLabelValues("error")
	}
	s.removeLeftovers()
	b, err := s.read()
	if err != nil {
		return nil, fmt.Errorf("bootstrap.state_file: %w", err)
	}
	if b == nil {
		log.Info("bootstrap.state_file does not exist yet: no registrations to restore", zap.String("state_file", s.path))
		return s, nil
	}
	doc, err := decodeState(b, s.max)
	if err != nil {
		aside := s.path + ".corrupt"
		rerr := os.Rename(s.path, aside)
		log.Warn("bootstrap.state_file is not a state file; starting with no registrations, the file set aside",
			zap.String("state_file", s.path), zap.String("set_aside", aside), zap.Error(err), zap.NamedError("rename_error", rerr))
		return s, nil
	}
	s.restore(doc)
	return s, nil
}

// read returns the file's bytes, nil when it does not exist, or an error
// when it cannot be read. Past the size bound it returns the first bytes
// over it, which decodeState refuses.
func (s *StateFile) read() ([]byte, error) {
	f, err := os.Open(s.path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, stateMaxBytes(s.max)+1))
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", s.path, err)
	}
	if b == nil {
		b = []byte{}
	}
	return b, nil
}

// stateMaxBytes bounds the state file of max registrations.
func stateMaxBytes(max int) int64 {
	return int64(max)*(maxEncoderURLLen+stateEntryBytes) + 1024
}

// decodeState parses and checks a state file of at most max registrations
// (more are allowed: max_encoders may have been lowered; restore keeps
// max).
func decodeState(b []byte, max int) (stateDoc, error) {
	var doc stateDoc
	if int64(len(b)) > stateMaxBytes(max) {
		return doc, fmt.Errorf("over %d bytes, the bound for bootstrap.max_encoders %d registrations", stateMaxBytes(max), max)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	if err := dec.Decode(&doc); err != nil {
		return doc, fmt.Errorf("not JSON: %w", err)
	}
	if dec.More() {
		return doc, errors.New("not one JSON document")
	}
	if doc.Version != stateVersion {
		return doc, fmt.Errorf("version %d, want %d", doc.Version, stateVersion)
	}
	if doc.SavedAt.IsZero() {
		return doc, errors.New("no saved_at")
	}
	seen := make(map[string]bool, len(doc.Encoders))
	for i, e := range doc.Encoders {
		u, _, err := ParseEncoderURL(e.URL)
		switch {
		case err != nil:
			return doc, fmt.Errorf("encoders[%d]: %w", i, err)
		case u != e.URL:
			return doc, fmt.Errorf("encoders[%d]: url %q is not normalised (%q)", i, e.URL, u)
		case seen[u]:
			return doc, fmt.Errorf("encoders[%d]: url %q twice", i, u)
		case e.RegisteredAt.IsZero() || e.ExpiresAt.IsZero():
			return doc, fmt.Errorf("encoders[%d]: registered_at and expires_at are required", i)
		case e.LastPassed != nil && e.LastPassed.IsZero():
			return doc, fmt.Errorf("encoders[%d]: last_passed is zero", i)
		}
		seen[u] = true
	}
	return doc, nil
}

// restore puts doc's registrations that have not expired into the store:
// at most max, keeping the healthiest (the last in Room's order of
// victims), their times moved on by the time since doc was written.
func (s *StateFile) restore(doc stateDoc) {
	now := s.clk.Now()
	shift := max(now.Sub(doc.SavedAt), 0)
	moved := func(t time.Time) time.Time {
		if t = t.Add(shift); t.After(now) {
			return now
		}
		return t
	}
	type kept struct {
		url string
		e   *memEntry
	}
	var keep []kept
	expired := 0
	for _, se := range doc.Encoders {
		if !se.ExpiresAt.After(now) {
			expired++
			continue
		}
		e := &memEntry{exp: se.ExpiresAt, registered: moved(se.RegisteredAt)}
		if se.LastPassed != nil {
			e.passed = moved(*se.LastPassed)
		}
		keep = append(keep, kept{se.URL, e})
	}
	// Room's order: never passed before passed, each oldest first; the
	// last max are kept.
	sort.Slice(keep, func(i, j int) bool {
		a, b := keep[i].e, keep[j].e
		if a.passed.IsZero() != b.passed.IsZero() {
			return a.passed.IsZero()
		}
		ta, tb := a.passed, b.passed
		if a.passed.IsZero() {
			ta, tb = a.registered, b.registered
		}
		if !ta.Equal(tb) {
			return ta.Before(tb)
		}
		return keep[i].url < keep[j].url
	})
	over := max(len(keep)-s.max, 0)
	s.store.mu.Lock()
	for _, k := range keep[over:] {
		s.store.live[k.url] = k.e
	}
	s.store.mu.Unlock()
	urls := make([]string, 0, len(keep)-over)
	for _, k := range keep[over:] {
		urls = append(urls, k.url)
	}
	sort.Strings(urls)
	s.log.Info("restored registrations from bootstrap.state_file", zap.String("state_file", s.path),
		zap.Strings("urls", urls), zap.Int("expired", expired), zap.Int("over_max_encoders", over),
		zap.Time("saved_at", doc.SavedAt), zap.Duration("since", shift))
}

// snapshot is the store's live registrations, sorted by URL, as a state
// file at now.
func (s *StateFile) snapshot() stateDoc {
	m := s.store
	m.mu.Lock()
	now := m.clk.Now()
	doc := stateDoc{Version: stateVersion, SavedAt: now, Encoders: make([]stateEntry, 0, len(m.live))}
	for u, e := range m.live {
		if !e.exp.After(now) {
			continue
		}
		se := stateEntry{URL: u, RegisteredAt: e.registered, ExpiresAt: e.exp}
		if !e.passed.IsZero() {
			p := e.passed
			se.LastPassed = &p
		}
		doc.Encoders = append(doc.Encoders, se)
	}
	m.mu.Unlock()
	sort.Slice(doc.Encoders, func(i, j int) bool { return doc.Encoders[i].URL < doc.Encoders[j].URL })
	return doc
}

// Save writes the store's registrations to the file now, atomically.
func (s *StateFile) Save() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	b, err := json.Marshal(s.snapshot())
	if err == nil {
		err = s.writeAtomic(append(b, '\n'))
	}
	if s.writes != nil {
		result := "ok"
		if err != nil {
			result = "error"
		}
		s.writes.WithLabelValues(result).Inc()
	}
	if err != nil {
		return fmt.Errorf("bootstrap.state_file: %w", err)
	}
	return nil
}

// writeAtomic replaces the file by b: a temporary file in its directory,
// written and synced, renamed over it, and the directory synced, so that
// the rename itself is durable. On any failure the temporary file is
// removed and the file is as it was.
func (s *StateFile) writeAtomic(b []byte) (err error) {
	dir := filepath.Dir(s.path)
	f, err := os.CreateTemp(dir, filepath.Base(s.path)+".tmp-*")
	if err != nil {
		return err
	}
	tmp, closed := f.Name(), false
	defer func() {
		if err != nil {
			if !closed {
				_ = f.Close()
			}
			_ = os.Remove(tmp)
		}
	}()
	if err = s.write(f, b); err != nil {
		return fmt.Errorf("writing %s: %w", tmp, err)
	}
	if err = f.Sync(); err != nil {
		return err
	}
	closed = true
	if err = f.Close(); err != nil {
		return err
	}
	if err = os.Rename(tmp, s.path); err != nil {
		return err
	}
	return syncDir(dir)
}

// syncDir makes the entries of dir (a rename into it) durable.
func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// removeLeftovers removes the temporary files of writes cut short (a crash
// between creating one and renaming it). Only the file itself is ever read.
func (s *StateFile) removeLeftovers() {
	dir, prefix := filepath.Dir(s.path), filepath.Base(s.path)+".tmp-"
	ents, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), prefix) && e.Type().IsRegular() {
			if err := os.Remove(filepath.Join(dir, e.Name())); err == nil {
				s.log.Info("removed the temporary file of a state file write cut short", zap.String("file", e.Name()))
			}
		}
	}
}

// Run writes the file whenever the store changes, at most once per
// state_write_interval (the first change at once, the ones during the
// interval together after it), until ctx ends. A write that fails is
// logged and counted; the next change tries again. The last write, at
// shutdown, is the caller's Save, after the registry's last change.
func (s *StateFile) Run(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.store.changed:
		}
		if err := s.Save(); err != nil {
			s.log.Warn("writing the registrations failed; a crash now would lose the changes since the last write", zap.Error(err))
		}
		t := s.clk.NewTimer(s.every)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C():
		}
	}
}
