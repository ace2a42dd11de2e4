package pipeline

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"unsafe"
)

// asyncSource copies into its own buffers (one per slot) on a goroutine per
// Start, as a device source's copy engine does, and records every misuse of
// the Chunks contract it sees: a slot started while in flight, a Wait for a
// slot not started, Close with chunks in flight, Close twice, a slot beyond
// depth. failStart/failWait inject an error at that chunk index (-1: none).
type asyncSource struct {
	data      []byte
	failStart int
	failWait  int
	short     int // chunk index whose Wait returns one byte too few (-1: none)

	mu       sync.Mutex
	opens    int
	closes   int
	misuse   []string
	maxDepth int
	bufs     int // buffers allocated over every pass
}

func newAsync(n int) *asyncSource {
	return &asyncSource{data: pattern(n), failStart: -1, failWait: -1, short: -1}
}

func pattern(n int) []byte {
	b := make([]byte, n)
	x := uint32(2463534242)
	for i := range b {
		x ^= x << 13
		x ^= x >> 17
		x ^= x << 5
		b[i] = byte(x)
	}
	return b
}

func (s *asyncSource) Len() int64 { return int64(len(s.data)) }

func (s *asyncSource) Open(_ context.Context, chunk, depth int) (Chunks, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.opens++
	s.maxDepth = max(s.maxDepth, depth)
	c := &asyncChunks{src: s, chunk: chunk, slots: make([]asyncSlot, depth)}
	for i := range c.slots {
		c.slots[i].buf = make([]byte, chunk)
		s.bufs++
	}
	return c, nil
}

func (s *asyncSource) misused(format string, args ...any) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.misuse = append(s.misuse, fmt.Sprintf(format, args...))
}

type asyncSlot struct {
	buf   []byte
	n     int
	index int
	busy  bool
	done  chan error
}

type asyncChunks struct {
	src    *asyncSource
	chunk  int
	slots  []asyncSlot
	next   int // chunk index of the next Start
	closed bool
}

func (c *asyncChunks) Start(slot int, off int64, n int) error {
	if slot < 0 || slot >= len(c.slots) {
		c.src.misused("Start of slot %d with depth %d", slot, len(c.slots))
		return errors.New("bad slot")
	}
	sl := &c.slots[slot]
	if sl.busy {
		c.src.misused("Start of slot %d while chunk %d is in flight in it", slot, sl.index)
	}
	if n <= 0 || n > c.chunk {
		c.src.misused("Start of %d bytes with chunk %d", n, c.chunk)
	}
	idx := c.next
	c.next++
	if idx == c.src.failStart {
		return fmt.Errorf("injected start failure at chunk %d", idx)
	}
	sl.busy, sl.n, sl.index, sl.done = true, n, idx, make(chan error, 1)
	buf, data := sl.buf, c.src.data
	failWait := idx == c.src.failWait
	go func(done chan error) {
		copy(buf[:n], data[off:off+int64(n)])
		if failWait {
			done <- fmt.Errorf("injected copy failure at chunk %d", idx)
			return
		}
		done <- nil
	}(sl.done)
	return nil
}

func (c *asyncChunks) Wait(slot int) ([]byte, error) {
	sl := &c.slots[slot]
	if !sl.busy {
		c.src.misused("Wait for slot %d, not started", slot)
		return nil, errors.New("not started")
	}
	err := <-sl.done
	sl.busy = false
	if err != nil {
		return nil, err
	}
	n := sl.n
	if sl.index == c.src.short {
		n--
	}
	return sl.buf[:n], nil
}

func (c *asyncChunks) Close() error {
	c.src.mu.Lock()
	c.src.closes++
	c.src.mu.Unlock()
	if c.closed {
		c.src.misused("Close twice")
	}
	c.closed = true
	for i := range c.slots {
		if c.slots[i].busy {
			c.src.misused("Close with chunk %d in flight in slot %d", c.slots[i].index, i)
		}
	}
	return nil
}

// check fails t for any recorded misuse, and unless every Open was closed.
func (s *asyncSource) check(t *testing.T) {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, m := range s.misuse {
		t.Error("contract broken: " + m)
	}
	if s.opens != s.closes {
		t.Errorf("%d passes opened, %d closed", s.opens, s.closes)
	}
}

// The bytes arrive in order, whole, for sizes that are and are not a
// multiple of the chunk, with depths 1 to 4 and more slots than chunks.
func TestSendWritesEveryByteInOrder(t *testing.T) {
	for _, size := range []int{1, 4096, 4097, 64<<10 - 1, 1 << 20} {
		for _, depth := range []int{1, 2, 3, 4, 64} {
			for _, chunk := range []int{1000, 4096, 1 << 20} {
				if size/chunk > 2000 {
					continue
				}
				src := newAsync(size)
				var out bytes.Buffer
				if err := Send(context.Background(), &out, src, Config{ChunkBytes: chunk, Depth: depth}); err != nil {
					t.Fatalf("size %d depth %d chunk %d: %v", size, depth, chunk, err)
				}
				if !bytes.Equal(out.Bytes(), src.data) {
					t.Fatalf("size %d depth %d chunk %d: bytes differ", size, depth, chunk)
				}
				src.check(t)
				chunks := (size + chunk - 1) / chunk
				if want := min(depth, chunks); src.maxDepth != want || src.bufs != want {
					t.Fatalf("size %d depth %d chunk %d: opened with depth %d and %d buffers, want %d (buffers are reused, not allocated per chunk)",
						size, depth, chunk, src.maxDepth, src.bufs, want)
				}
			}
		}
	}
}

// failingWriter accepts limit bytes, then fails; cancel, when set, is
// called instead of failing.
type failingWriter struct {
	limit  int
	n      int
	cancel context.CancelFunc
}

var errWriter = errors.New("injected writer failure")

func (w *failingWriter) Write(p []byte) (int, error) {
	if w.n+len(p) > w.limit {
		if w.cancel != nil {
			w.cancel()
			w.n += len(p)
			return len(p), nil
		}
		return 0, errWriter
	}
	w.n += len(p)
	return len(p), nil
}

// A failure at any point, of the source or of the writer, or the context
// ending, stops the pass with that error; every chunk in flight is waited
// for before the pass is closed, and it is closed once.
func TestSendStopsCleanlyOnEveryFailure(t *testing.T) {
	const size, chunk, depth = 10 * 4096, 4096, 3
	for k := range 10 {
		cases := []struct {
			name  string
			setup func(*asyncSource) (context.Context, *failingWriter)
			want  string
		}{
			{"start fails", func(s *asyncSource) (context.Context, *failingWriter) {
				s.failStart = k
				return context.Background(), &failingWriter{limit: size}
			}, fmt.Sprintf("injected start failure at chunk %d", k)},
			{"copy fails", func(s *asyncSource) (context.Context, *failingWriter) {
				s.failWait = k
				return context.Background(), &failingWriter{limit: size}
			}, fmt.Sprintf("injected copy failure at chunk %d", k)},
			{"short chunk", func(s *asyncSource) (context.Context, *failingWriter) {
				s.short = k
				return context.Background(), &failingWriter{limit: size}
			}, ErrShortChunk.Error()},
			{"writer fails", func(*asyncSource) (context.Context, *failingWriter) {
				return context.Background(), &failingWriter{limit: k * chunk}
			}, errWriter.Error()},
			{"context ends", func(*asyncSource) (context.Context, *failingWriter) {
				ctx, cancel := context.WithCancel(context.Background())
				t.Cleanup(cancel)
				return ctx, &failingWriter{limit: k * chunk, cancel: cancel}
			}, context.Canceled.Error()},
		}
		for _, tc := range cases {
			if tc.name == "context ends" && k == 9 {
				continue // the cancel comes with the last chunk: nothing is left to stop
			}
			src := newAsync(size)
			ctx, w := tc.setup(src)
			err := Send(ctx, w, src, Config{ChunkBytes: chunk, Depth: depth})
			if err == nil || !bytes.Contains([]byte(err.Error()), []byte(tc.want)) {
				t.Fatalf("%s at chunk %d: Send = %v, want %q", tc.name, k, err, tc.want)
			}
			src.check(t)
		}
	}
}

// Host chunks are slices of the embedding itself: nothing is copied.
func TestHostChunksAreTheEmbeddingItself(t *testing.T) {
	data := pattern(10000)
	var seen [][]byte
	w := writerFunc(func(p []byte) (int, error) { seen = append(seen, p); return len(p), nil })
	if err := Send(context.Background(), w, Host(data), Config{ChunkBytes: 4096, Depth: 3}); err != nil {
		t.Fatal(err)
	}
	if len(seen) != 3 {
		t.Fatalf("%d writes, want 3 chunks", len(seen))
	}
	off := 0
	for i, p := range seen {
		if unsafe.SliceData(p) != &data[off] {
			t.Fatalf("chunk %d is a copy, not data[%d:]", i, off)
		}
		if cap(p) != len(p) {
			t.Fatalf("chunk %d has capacity past its end (%d > %d): a writer could reach the next chunk", i, cap(p), len(p))
		}
		off += len(p)
	}
	if off != len(data) {
		t.Fatalf("%d bytes written, want %d", off, len(data))
	}
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

// An empty source sends nothing and opens no pass; a bad chunking is
// refused before the source is touched.
func TestSendEdgeCases(t *testing.T) {
	src := newAsync(0)
	if err := Send(context.Background(), &bytes.Buffer{}, src, Config{ChunkBytes: 1, Depth: 1}); err != nil || src.opens != 0 {
		t.Fatalf("empty source: err %v, %d opens", err, src.opens)
	}
	src = newAsync(10)
	for _, cfg := range []Config{{0, 1}, {1, 0}, {-1, 2}} {
		if err := Send(context.Background(), &bytes.Buffer{}, src, cfg); err == nil || src.opens != 0 {
			t.Fatalf("%+v: err %v, %d opens", cfg, err, src.opens)
		}
	}
}

// A Transfer sends the same bytes on every call (an initiator's retry
// sends it again from the start).
func TestTransferSendsAgainFromTheStart(t *testing.T) {
	src := newAsync(100000)
	tr := Transfer{Source: src, Config: Config{ChunkBytes: 8192, Depth: 2}}
	for range 2 {
		var out bytes.Buffer
		if err := tr.Send(context.Background(), &out); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(out.Bytes(), src.data) || tr.Len() != int64(len(src.data)) {
			t.Fatal("bytes differ")
		}
	}
	src.check(t)
}
