package gpuagent

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/encgate/encgate/gpuagent/pipeline"
	"github.com/encgate/encgate/internal/cuda"
)

// Stage by handle (source=cuda). The encoder passes a CUDA IPC handle for
// the allocation that holds its embedding, the offset inside it and the
// device ordinal. The agent opens the handle, copies the bytes into device
// memory of its own (device to device, on its own stream), closes the
// handle and only then answers: the encoder may free or reuse the tensor
// as soon as it has the answer. Keeping the handle open until /send instead
// would not be enough: PyTorch's caching allocator hands a freed tensor's
// block to the next tensor without freeing it, so the bytes would change
// under the agent, and the CUDA documentation makes freeing an allocation
// that another process has open undefined. The device copy costs the
// device's own bandwidth (hundreds of GB/s), not PCIe.
//
// At /send the staged device copy is the pipeline's device source: each
// chunk is copied into a pinned host buffer with cuMemcpyDtoHAsync on a
// lane's stream, an event recorded after it, and written to the Mooncake
// connection once its event completes, while the next chunks copy.

// gpus is the agent's CUDA state: the driver (nil when unavailable, with
// why), and a gpu per device ordinal used.
type gpus struct {
	cfg    CUDAConfig
	pipe   pipeline.Config
	m      *metrics
	drv    *cuda.Driver
	reason string // why stage-by-handle is refused; "" when drv is set

	mu   sync.Mutex
	devs map[int]*gpu
}

// openGPUs loads the driver as cfg.Mode says. With required, a driver or
// device that cannot be used is an error.
func openGPUs(cfg CUDAConfig, pipe pipeline.Config, log *zap.Logger, m *metrics) (*gpus, error) {
	g := &gpus{cfg: cfg, pipe: pipe, m: m, devs: map[int]*gpu{}}
	if cfg.Mode == CUDAOff {
		g.reason = "cuda.mode is off in this agent's config"
		return g, nil
	}
	drv, err := cuda.Open(cfg.Library)
	if err == nil {
		var n int
		if n, err = drv.DeviceCount(); err == nil && n == 0 {
			err = errors.New("the CUDA driver sees no device")
		}
	}
	if err != nil {
		g.reason = err.Error()
		if cfg.Mode == CUDARequired {
			return nil, fmt.Errorf("cuda.mode is required, but CUDA cannot be used: %s", g.reason)
		}
		log.Info("CUDA is not available: stages by CUDA IPC handle (source=cuda) will be refused", zap.String("reason", g.reason))
		return g, nil
	}
	g.drv = drv
	v, _ := drv.DriverVersion()
	n, _ := drv.DeviceCount()
	log.Info("CUDA driver loaded: stages by CUDA IPC handle are accepted", zap.Int("driver_version", v), zap.Int("devices", n))
	return g, nil
}

// device returns the gpu for ordinal, retaining its context at first use;
// the error says why it cannot be used.
func (g *gpus) device(ordinal int) (*gpu, error) {
	if g.drv == nil {
		return nil, errors.New(g.reason)
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if d := g.devs[ordinal]; d != nil {
		return d, nil
	}
	dev, err := g.drv.Device(ordinal)
	if err != nil {
		return nil, err
	}
	stream, err := dev.NewStream()
	if err != nil {
		_ = dev.Close()
		return nil, err
	}
	d := &gpu{dev: dev, stage: stream, heldGauge: g.m.deviceBytes.WithLabelValues(strconv.Itoa(ordinal)), capacity: int64(g.cfg.CapacityBytes), pipe: g.pipe,
		lanes: make(chan *lane, g.cfg.Lanes), free: g.cfg.Lanes, opened: map[cuda.IPCHandle]*ipcMapping{}}
	g.devs[ordinal] = d
	return d, nil
}

// gpu is one device: its stage stream, its staged bytes, its lanes.
type gpu struct {
	dev  *cuda.Device
	pipe pipeline.Config

	stageMu sync.Mutex // serialises the stage stream's copies
	stage   *cuda.Stream

	mu        sync.Mutex
	capacity  int64
	held      int64
	heldGauge prometheus.Gauge // encgate_agent_staged_device_bytes{device}
	opened    map[cuda.IPCHandle]*ipcMapping
	// lanes holds the idle lanes; free is how many more may be made. Lanes
	// and contexts live as long as the process (see Agent.gpus).
	lanes chan *lane
	free  int
}

// ipcMapping is an opened IPC handle; refs counts the stages using it (a
// handle is opened once per process: PyTorch's tensors share allocations).
type ipcMapping struct {
	ptr  cuda.DevPtr
	size int64
	refs int
}

// stageErr is a stage by handle that failed: status and message.
type stageErr struct {
	status int
	msg    string
}

func (e *stageErr) Error() string { return e.msg }

// copyIn copies n bytes at offset in the allocation behind h into fresh
// device memory of the agent's and returns it. The handle is closed before
// copyIn returns.
func (d *gpu) copyIn(h cuda.IPCHandle, offset, n int64) (reg region, err error) {
	d.mu.Lock()
	if n > d.capacity-d.held {
		held := d.held
		d.mu.Unlock()
		return region{}, &stageErr{status: 507, msg: fmt.Sprintf(
			"staging %d bytes would exceed cuda.capacity_bytes on device %d (%d bytes held)", n, d.dev.Ordinal(), held)}
	}
	d.held += n
	d.heldGauge.Set(float64(d.held))
	d.mu.Unlock()
	defer func() {
		if err != nil {
			d.release(n)
		}
	}()
	src, size, err := d.openIPC(h)
	if err != nil {
		return region{}, &stageErr{status: 400, msg: fmt.Sprintf("cannot open the CUDA IPC handle on device %d: %v", d.dev.Ordinal(), err)}
	}
	defer d.closeIPC(h)
	if offset > size || n > size-offset {
		return region{}, &stageErr{status: 400, msg: fmt.Sprintf(
			"the allocation behind the handle holds %d bytes, fewer than offset %d + %d", size, offset, n)}
	}
	dst, err := d.dev.Alloc(n)
	if err != nil {
		return region{}, &stageErr{status: 507, msg: fmt.Sprintf("allocating %d bytes on device %d: %v", n, d.dev.Ordinal(), err)}
	}
	d.stageMu.Lock()
	err = d.stage.CopyDtoDAsync(dst, src+cuda.DevPtr(offset), n)
	if err == nil {
		err = d.stage.Synchronize()
	}
	d.stageMu.Unlock()
	if err != nil {
		_ = d.dev.Free(dst)
		return region{}, &stageErr{status: 500, msg: fmt.Sprintf("copying %d bytes out of the IPC allocation on device %d: %v", n, d.dev.Ordinal(), err)}
	}
	return region{device: &deviceMem{gpu: d, ptr: dst, n: n}}, nil
}

func (d *gpu) release(n int64) {
	d.mu.Lock()
	d.held -= n
	d.heldGauge.Set(float64(d.held))
	d.mu.Unlock()
}

func (d *gpu) openIPC(h cuda.IPCHandle) (cuda.DevPtr, int64, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if m := d.opened[h]; m != nil {
		m.refs++
		return m.ptr, m.size, nil
	}
	p, err := d.dev.OpenIPC(h)
	if err != nil {
		return 0, 0, err
	}
	base, size, err := d.dev.AddressRange(p)
	if err != nil {
		_ = d.dev.CloseIPC(p)
		return 0, 0, err
	}
	size -= int64(p - base)
	d.opened[h] = &ipcMapping{ptr: p, size: size, refs: 1}
	return p, size, nil
}

func (d *gpu) closeIPC(h cuda.IPCHandle) {
	d.mu.Lock()
	defer d.mu.Unlock()
	m := d.opened[h]
	if m.refs--; m.refs == 0 {
		delete(d.opened, h)
		_ = d.dev.CloseIPC(m.ptr)
	}
}

// lane is what one device transfer holds: a stream, and per slot a pinned
// buffer and the event recorded after the slot's copy.
type lane struct {
	stream *cuda.Stream
	bufs   [][]byte
	events []*cuda.Event
}

// takeLane returns an idle lane, makes one while fewer than cuda.lanes
// exist, or waits for one.
func (d *gpu) takeLane(ctx context.Context) (*lane, error) {
	select {
	case l := <-d.lanes:
		return l, nil
	default:
	}
	d.mu.Lock()
	if d.free > 0 {
		d.free--
		d.mu.Unlock()
		l, err := d.newLane()
		if err != nil {
			d.mu.Lock()
			d.free++
			d.mu.Unlock()
		}
		return l, err
	}
	d.mu.Unlock()
	select {
	case l := <-d.lanes:
		return l, nil
	case <-ctx.Done():
		return nil, fmt.Errorf("waiting for one of device %d's cuda.lanes (%d, all in use): %w", d.dev.Ordinal(), cap(d.lanes), ctx.Err())
	}
}

func (d *gpu) newLane() (l *lane, err error) {
	l = &lane{}
	defer func() {
		if err != nil {
			l.free(d.dev)
		}
	}()
	if l.stream, err = d.dev.NewStream(); err != nil {
		return nil, err
	}
	for range d.pipe.Depth {
		b, err := d.dev.HostAlloc(d.pipe.ChunkBytes)
		if err != nil {
			return nil, fmt.Errorf("allocating a pinned buffer of %d bytes: %w", d.pipe.ChunkBytes, err)
		}
		l.bufs = append(l.bufs, b)
		ev, err := d.dev.NewEvent()
		if err != nil {
			return nil, err
		}
		l.events = append(l.events, ev)
	}
	return l, nil
}

func (l *lane) free(dev *cuda.Device) {
	for _, ev := range l.events {
		_ = ev.Close()
	}
	for _, b := range l.bufs {
		_ = dev.HostFree(b)
	}
	if l.stream != nil {
		_ = l.stream.Close()
	}
}

// deviceMem is a staged embedding's device copy: the pipeline's device
// source.
type deviceMem struct {
	gpu *gpu
	ptr cuda.DevPtr
	n   int64
}

func (m *deviceMem) free() error {
	err := m.gpu.dev.Free(m.ptr)
	m.gpu.release(m.n)
	return err
}

// Len is the embedding's size.
func (m *deviceMem) Len() int64 { return m.n }

// Open takes a lane for one pass.
func (m *deviceMem) Open(ctx context.Context, chunk, depth int) (pipeline.Chunks, error) {
	if chunk > m.gpu.pipe.ChunkBytes || depth > m.gpu.pipe.Depth {
		return nil, fmt.Errorf("a pass of %d slots of %d bytes is larger than a lane (%d of %d)", depth, chunk, m.gpu.pipe.Depth, m.gpu.pipe.ChunkBytes)
	}
	l, err := m.gpu.takeLane(ctx)
	if err != nil {
		return nil, err
	}
	return &deviceChunks{m: m, l: l, n: make([]int, depth)}, nil
}

type deviceChunks struct {
	m *deviceMem
	l *lane
	n []int
}

func (c *deviceChunks) Start(slot int, off int64, n int) error {
	if err := c.l.stream.CopyDtoHAsync(c.l.bufs[slot][:n], c.m.ptr+cuda.DevPtr(off)); err != nil {
		return err
	}
	c.n[slot] = n
	return c.l.events[slot].Record(c.l.stream)
}

func (c *deviceChunks) Wait(slot int) ([]byte, error) {
	if err := c.l.events[slot].Synchronize(); err != nil {
		return nil, err
	}
	return c.l.bufs[slot][:c.n[slot]:c.n[slot]], nil
}

// Close gives the lane back. Send waited for every slot, but a Start whose
// copy was queued and whose Record failed left a copy in flight: the
// stream is synchronised first so the next pass cannot see it land.
func (c *deviceChunks) Close() error {
	err := c.l.stream.Synchronize()
	c.m.gpu.lanes <- c.l
	return err
}

// heldBytes is the device memory held for staged embeddings.
func (d *gpu) heldBytes() int64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.held
}
