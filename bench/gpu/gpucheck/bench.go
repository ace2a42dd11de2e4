package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"time"

	"github.com/encgate/encgate/gpuagent/pipeline"
	"github.com/encgate/encgate/internal/cuda"
)

// median of ds (the mean of the middle two for an even count).
func median(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// rate is size bytes over the median of ds, in GB/s (10^9 bytes/s).
func rate(size int64, ds []time.Duration) float64 {
	m := median(ds)
	if m <= 0 {
		return 0
	}
	return float64(size) / m.Seconds() / 1e9
}

// devSource is device memory as a pipeline.Source, read the way the agent
// reads a staged device copy (gpuagent/cuda.go): per slot a slice of one
// pinned buffer and an event; each chunk is copied with cuMemcpyDtoHAsync
// on one stream and the event recorded after it; Wait synchronises the
// slot's event.
type devSource struct {
	ptr    cuda.DevPtr
	n      int64
	stream *cuda.Stream
	pinned []byte // chunk × depth bytes, from HostAlloc
	events []*cuda.Event
	chunk  int
}

func (s *devSource) Len() int64 { return s.n }

func (s *devSource) Open(_ context.Context, chunk, depth int) (pipeline.Chunks, error) {
	if chunk > s.chunk || depth > len(s.events) {
		return nil, fmt.Errorf("a pass of %d slots of %d bytes is larger than the %d slots of %d bytes", depth, chunk, len(s.events), s.chunk)
	}
	return &devChunks{s: s, n: make([]int, depth)}, nil
}

type devChunks struct {
	s *devSource
	n []int
}

func (c *devChunks) slot(i int) []byte { return c.s.pinned[i*c.s.chunk : (i+1)*c.s.chunk] }

func (c *devChunks) Start(slot int, off int64, n int) error {
	if err := c.s.stream.CopyDtoHAsync(c.slot(slot)[:n], c.s.ptr+cuda.DevPtr(off)); err != nil {
		return err
	}
	c.n[slot] = n
	return c.s.events[slot].Record(c.s.stream)
}

func (c *devChunks) Wait(slot int) ([]byte, error) {
	if err := c.s.events[slot].Synchronize(); err != nil {
		return nil, err
	}
	return c.slot(slot)[:c.n[slot]:c.n[slot]], nil
}

func (c *devChunks) Close() error { return c.s.stream.Synchronize() }

// checkWriter checks what is written, in order, against the pattern.
type checkWriter struct {
	seed    uint64
	off     int64
	size    int64
	where   string
	scratch []byte
}

func (w *checkWriter) Write(b []byte) (int, error) {
	if len(w.scratch) < len(b) {
		w.scratch = make([]byte, len(b))
	}
	if err := verify(b, w.scratch, w.seed, w.off, w.size, w.where, "checked in gpucheck's pinned buffer"); err != nil {
		return 0, err
	}
	w.off += int64(len(b))
	return len(b), nil
}

// benchDtoH fills r.size bytes of device memory with the pattern and times
// copying them to the host: chunked for each pair, and whole.
func (c *check) benchDtoH(ctx context.Context, r *sizeResult) (err error) {
	dev, size, seed := c.dev, r.size, c.o.verifySeed
	ptr, err := dev.Alloc(size)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, dev.Free(ptr)) }()
	fill := make([]byte, min(size, 8<<20))
	for off := int64(0); off < size; off += int64(len(fill)) {
		b := fill[:min(int64(len(fill)), size-off)]
		cuda.FillPattern(b, seed, off)
		if err := dev.CopyHtoD(ptr+cuda.DevPtr(off), b); err != nil {
			return err
		}
	}
	if err := dev.Synchronize(); err != nil {
		return err
	}
	stream, err := dev.NewStream()
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, stream.Close()) }()

	for _, p := range c.o.pairs {
		d, err := c.dtohChunked(ctx, stream, ptr, size, p)
		if err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
		r.dtohChunk[p] = d
		c.logf("size %s, %s: device-to-host chunked %.2f GB/s", sizeName(size), p, rate(size, d))
	}

	whole, err := dev.HostAlloc(int(size))
	if err != nil {
		return fmt.Errorf("a pinned buffer of %d bytes: %w", size, err)
	}
	defer func() { err = errors.Join(err, dev.HostFree(whole)) }()
	for i := 0; i <= c.o.rounds; i++ { // pass 0 is checked, not timed
		if err := ctx.Err(); err != nil {
			return err
		}
		if i == 0 {
			clear(whole)
		}
		t0 := time.Now()
		if err := stream.CopyDtoHAsync(whole, ptr); err != nil {
			return err
		}
		if err := stream.Synchronize(); err != nil {
			return err
		}
		d := time.Since(t0)
		if i == 0 {
			where := fmt.Sprintf("device-to-host, size %s, one whole copy", sizeName(size))
			if err := verify(whole, make([]byte, size), seed, 0, size, where, "checked in gpucheck's pinned buffer"); err != nil {
				return err
			}
			c.verified.dtoh += size
			continue
		}
		r.dtohWhole = append(r.dtohWhole, d)
	}
	c.logf("size %s: device-to-host whole %.2f GB/s", sizeName(size), rate(size, r.dtohWhole))
	return nil
}

// dtohChunked times pipeline.Send of the device range into io.Discard with
// p's chunk and depth; its first pass is checked instead of timed.
func (c *check) dtohChunked(ctx context.Context, stream *cuda.Stream, ptr cuda.DevPtr, size int64, p pair) (times []time.Duration, err error) {
	dev := c.dev
	chunk := int(min(int64(p.chunk), size))
	pinned, err := dev.HostAlloc(chunk * p.buffers)
	if err != nil {
		return nil, fmt.Errorf("a pinned buffer of %d × %d bytes: %w", p.buffers, chunk, err)
	}
	defer func() { err = errors.Join(err, dev.HostFree(pinned)) }()
	src := &devSource{ptr: ptr, n: size, stream: stream, pinned: pinned, chunk: chunk}
	defer func() {
		for _, e := range src.events {
			err = errors.Join(err, e.Close())
		}
	}()
	for range p.buffers {
		e, err := dev.NewEvent()
		if err != nil {
			return nil, err
		}
		src.events = append(src.events, e)
	}
	cfg := pipeline.Config{ChunkBytes: chunk, Depth: p.buffers}
	for i := 0; i <= c.o.rounds; i++ {
		var w io.Writer = io.Discard
		if i == 0 {
			clear(pinned)
			w = &checkWriter{seed: c.o.verifySeed, size: size,
				where: fmt.Sprintf("device-to-host, size %s, %s", sizeName(size), p)}
		}
		t0 := time.Now()
		if err := pipeline.Send(ctx, w, src, cfg); err != nil {
			return nil, err
		}
		d := time.Since(t0)
		if i == 0 {
			c.verified.dtoh += size
			continue
		}
		times = append(times, d)
	}
	return times, nil
}

// benchTCP times writing size bytes over one loopback connection into one
// buffer, answered by one byte, rounds times after one untimed round whose
// bytes are checked.
func benchTCP(ctx context.Context, size int64, rounds int) (times []time.Duration, err error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	defer ln.Close()
	type accepted struct {
		c   net.Conn
		err error
	}
	acc := make(chan accepted, 1)
	go func() {
		c, err := ln.Accept()
		acc <- accepted{c, err}
	}()
	var d net.Dialer
	w, err := d.DialContext(ctx, "tcp", ln.Addr().String())
	if err != nil {
		return nil, err
	}
	defer w.Close()
	a := <-acc
	if a.err != nil {
		return nil, a.err
	}
	rc := a.c
	defer rc.Close()
	stop := context.AfterFunc(ctx, func() {
		_ = w.SetDeadline(time.Now())
		_ = rc.SetDeadline(time.Now())
	})
	defer stop()

	src := make([]byte, size)
	cuda.FillPattern(src, 1, 0)
	dst := make([]byte, size)
	readErr := make(chan error, 1)
	go func() {
		defer rc.Close() // a failure here ends the writer's wait for its ack
		for i := range rounds + 1 {
			if _, err := io.ReadFull(rc, dst); err != nil {
				readErr <- err
				return
			}
			if i == 0 && !bytes.Equal(src, dst) {
				readErr <- errors.New("the loopback reader got other bytes than were written")
				return
			}
			if _, err := rc.Write([]byte{1}); err != nil {
				readErr <- err
				return
			}
		}
		readErr <- nil
	}()
	var ack [1]byte
	for i := 0; i <= rounds; i++ {
		t0 := time.Now()
		if _, err := w.Write(src); err != nil {
			return nil, errors.Join(err, <-readErr)
		}
		if _, err := io.ReadFull(w, ack[:]); err != nil {
			return nil, errors.Join(err, <-readErr)
		}
		if elapsed := time.Since(t0); i > 0 {
			times = append(times, elapsed)
		}
	}
	if err := <-readErr; err != nil {
		return nil, err
	}
	return times, ctx.Err()
}
