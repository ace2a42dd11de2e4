// Package pipeline sends a staged embedding in chunks, readying the next
// chunks while the current one is written: for an embedding in device
// memory, the copies into pinned host buffers overlap the socket writes.
//
// A Source is the embedding; each pass over it (one transfer attempt) opens
// Chunks, which hold what the pass needs (pinned buffers, a CUDA stream) and
// ready chunks in slots. Send keeps up to depth slots in flight: it starts
// chunks 0..depth-1, then waits for chunk i, writes it, and starts chunk
// i+depth in the slot that chunk i just freed. Host memory is a Source too
// (its chunks are slices of itself, so it copies nothing), and runs the
// same code.
package pipeline

import (
	"context"
	"errors"
	"fmt"
	"io"
)

// Source is an embedding to send.
type Source interface {
	// Len is the embedding's size in bytes.
	Len() int64
	// Open begins one pass with up to depth slots of at most chunk bytes
	// each. It may wait for what the pass needs (ctx bounds the wait).
	Open(ctx context.Context, chunk, depth int) (Chunks, error)
}

// Chunks is one pass over a Source. Send calls its methods from one
// goroutine.
type Chunks interface {
	// Start begins readying the n bytes at off in slot (0 <= slot < depth,
	// 0 < n <= chunk) and returns without waiting for them. A slot is
	// started again only after Wait returned for it.
	Start(slot int, off int64, n int) error
	// Wait blocks until slot's bytes are ready and returns them; they stay
	// valid until the slot is started again or the pass is closed.
	Wait(slot int) ([]byte, error)
	// Close ends the pass. It is called once, after Wait returned for
	// every slot started, whatever failed.
	Close() error
}

// Config is the chunking of a pass.
type Config struct {
	ChunkBytes int // > 0
	Depth      int // slots in flight, >= 1 (2: double-buffered, 3: triple)
}

// Validate reports a chunking that cannot run.
func (c Config) Validate() error {
	if c.ChunkBytes <= 0 {
		return fmt.Errorf("chunk size must be > 0, got %d", c.ChunkBytes)
	}
	if c.Depth < 1 {
		return fmt.Errorf("depth must be >= 1, got %d", c.Depth)
	}
	return nil
}

// ErrShortChunk is a Wait that returned a different number of bytes than
// its Start asked for.
var ErrShortChunk = errors.New("pipeline: a chunk came back with the wrong length")

// Send writes src's bytes to w in order. It stops at the first failure (of
// the source, of w, or ctx ending between chunks) and returns it, after
// waiting for every chunk still in flight, so no copy is left writing into
// a buffer that the pass hands back.
func Send(ctx context.Context, w io.Writer, src Source, cfg Config) (err error) {
	if err := cfg.Validate(); err != nil {
		return err
	}
	size := src.Len()
	if size <= 0 {
		return nil
	}
	chunk := min(int64(cfg.ChunkBytes), size)
	count := (size + chunk - 1) / chunk
	depth := int(min(int64(cfg.Depth), count))
	ch, err := src.Open(ctx, int(chunk), depth)
	if err != nil {
		return err
	}
	span := func(i int64) (int64, int) {
		off := i * chunk
		return off, int(min(chunk, size-off))
	}
	var started, done int64 // chunks started, and chunks waited for
	defer func() {
		for ; done < started; done++ {
			_, _ = ch.Wait(int(done % int64(depth)))
		}
		if cerr := ch.Close(); err == nil {
			err = cerr
		}
	}()
	start := func() error {
		off, n := span(started)
		if err := ch.Start(int(started%int64(depth)), off, n); err != nil {
			return err
		}
		started++
		return nil
	}
	for started < int64(depth) {
		if err := start(); err != nil {
			return err
		}
	}
	for done < count {
		if err := ctx.Err(); err != nil {
			return err
		}
		_, n := span(done)
		b, err := ch.Wait(int(done % int64(depth)))
		done++
		if err != nil {
			return err
		}
		if len(b) != n {
			return fmt.Errorf("%w: chunk %d: %d bytes, want %d", ErrShortChunk, done-1, len(b), n)
		}
		if _, err := w.Write(b); err != nil {
			return err
		}
		if started < count {
			if err := start(); err != nil {
				return err
			}
		}
	}
	return nil
}

// Transfer is a Source with its chunking: a mooncake.Payload.
type Transfer struct {
	Source Source
	Config Config
}

// Len is the source's size.
func (t Transfer) Len() int64 { return t.Source.Len() }

// Send runs the pipeline into w.
func (t Transfer) Send(ctx context.Context, w io.Writer) error {
	return Send(ctx, w, t.Source, t.Config)
}

// Host is an embedding in host memory. Its chunks are slices of it: nothing
// is copied, and every Start is ready at once.
type Host []byte

// Len is len(h).
func (h Host) Len() int64 { return int64(len(h)) }

// Open returns a pass over h.
func (h Host) Open(_ context.Context, _, depth int) (Chunks, error) {
	return &hostChunks{data: h, spans: make([][2]int64, depth)}, nil
}

type hostChunks struct {
	data  []byte
	spans [][2]int64 // per slot: off, end
}

func (c *hostChunks) Start(slot int, off int64, n int) error {
	if off < 0 || off+int64(n) > int64(len(c.data)) {
		return fmt.Errorf("pipeline: chunk [%d, %d) is outside the %d bytes", off, off+int64(n), len(c.data))
	}
	c.spans[slot] = [2]int64{off, off + int64(n)}
	return nil
}

func (c *hostChunks) Wait(slot int) ([]byte, error) {
	s := c.spans[slot]
	return c.data[s[0]:s[1]:s[1]], nil
}

func (c *hostChunks) Close() error { return nil }
