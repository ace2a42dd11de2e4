package gpuagent

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"

	"github.com/encgate/encgate/internal/clock"
	"github.com/encgate/encgate/internal/configfile"
)

func TestParseStageQuery(t *testing.T) {
	tests := []struct {
		name  string
		query string
		want  stageRequest
		err   string
	}{
		{"bfloat16", "req_id=r&tokens=4&dim=8&dtype=bfloat16",
			stageRequest{ReqID: "r", Tokens: 4, Dim: 8, Dtype: "bfloat16", Elem: 2, NBytes: 64, Source: sourceBody}, ""},
		{"float32", "req_id=r&tokens=1&dim=3&dtype=float32",
			stageRequest{ReqID: "r", Tokens: 1, Dim: 3, Dtype: "float32", Elem: 4, NBytes: 12, Source: sourceBody}, ""},
		{"float16", "dtype=float16&dim=2&tokens=2&req_id=a%20b",
			stageRequest{ReqID: "a b", Tokens: 2, Dim: 2, Dtype: "float16", Elem: 2, NBytes: 8, Source: sourceBody}, ""},
		{"fp8 e4m3", "req_id=r&tokens=5&dim=5&dtype=float8_e4m3fn",
			stageRequest{ReqID: "r", Tokens: 5, Dim: 5, Dtype: "float8_e4m3fn", Elem: 1, NBytes: 25, Source: sourceBody}, ""},
		{"fp8 e5m2", "req_id=r&tokens=5&dim=5&dtype=float8_e5m2",
			stageRequest{ReqID: "r", Tokens: 5, Dim: 5, Dtype: "float8_e5m2", Elem: 1, NBytes: 25, Source: sourceBody}, ""},
		{"fd", "req_id=r&tokens=2&dim=2&dtype=float32&source=fd&offset=4100",
			stageRequest{ReqID: "r", Tokens: 2, Dim: 2, Dtype: "float32", Elem: 4, NBytes: 16, Source: sourceFD, Offset: 4100}, ""},
		{"fd no offset", "req_id=r&tokens=2&dim=2&dtype=float32&source=fd",
			stageRequest{ReqID: "r", Tokens: 2, Dim: 2, Dtype: "float32", Elem: 4, NBytes: 16, Source: sourceFD}, ""},
		{"body named", "req_id=r&tokens=2&dim=2&dtype=float32&source=body",
			stageRequest{ReqID: "r", Tokens: 2, Dim: 2, Dtype: "float32", Elem: 4, NBytes: 16, Source: sourceBody}, ""},
		{"error", "req_id=r&error=boom+now", stageRequest{ReqID: "r", Error: "boom now"}, ""},

		{"no req_id", "tokens=1&dim=1&dtype=float32", stageRequest{}, "missing or invalid req_id"},
		{"empty req_id", "req_id=&tokens=1&dim=1&dtype=float32", stageRequest{}, "missing or invalid req_id"},
		{"unknown dtype", "req_id=r&tokens=1&dim=1&dtype=int8", stageRequest{}, "unsupported dtype"},
		{"no dtype", "req_id=r&tokens=1&dim=1", stageRequest{}, "unsupported dtype"},
		{"zero tokens", "req_id=r&tokens=0&dim=1&dtype=float32", stageRequest{}, "tokens must be a positive integer"},
		{"negative dim", "req_id=r&tokens=1&dim=-1&dtype=float32", stageRequest{}, "dim must be a positive integer"},
		{"plus sign", "req_id=r&tokens=%2B1&dim=1&dtype=float32", stageRequest{}, "tokens must be"},
		{"float tokens", "req_id=r&tokens=1.5&dim=1&dtype=float32", stageRequest{}, "tokens must be"},
		{"huge tokens", "req_id=r&tokens=99999999999999999999&dim=1&dtype=float32", stageRequest{}, "tokens must be"},
		{"overflow", "req_id=r&tokens=4611686018427387904&dim=4&dtype=float32", stageRequest{}, "overflows"},
		{"duplicate", "req_id=r&req_id=s&tokens=1&dim=1&dtype=float32", stageRequest{}, "given 2 times"},
		{"unknown key", "req_id=r&tokens=1&dim=1&dtype=float32&shape=1", stageRequest{}, "unknown stage parameter"},
		{"bad escape", "req_id=%zz", stageRequest{}, "invalid stage query"},
		{"empty error", "req_id=r&error=", stageRequest{}, "error must not be empty"},
		{"error with shape", "req_id=r&error=x&tokens=1", stageRequest{}, "tokens cannot be given with error"},
		{"offset alone", "req_id=r&tokens=1&dim=1&dtype=float32&offset=0", stageRequest{}, "offset needs source=fd"},
		// No parameter names a file: the path form of earlier agents is gone.
		{"a path", "req_id=r&tokens=1&dim=1&dtype=float32&shm=/dev/shm/victim", stageRequest{}, `unknown stage parameter "shm"`},
		{"unknown source", "req_id=r&tokens=1&dim=1&dtype=float32&source=/dev/shm/victim", stageRequest{}, "source must be body, fd or cuda"},
		{"bad offset", "req_id=r&tokens=1&dim=1&dtype=float32&source=fd&offset=-4", stageRequest{}, "offset must be"},
		{"offset overflow", "req_id=r&tokens=1&dim=1&dtype=float32&source=fd&offset=9223372036854775807", stageRequest{}, "offset+size overflows"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseStageQuery(tc.query)
			if tc.err != "" {
				var bad *badRequest
				if err == nil || !strings.Contains(err.Error(), tc.err) || !errors.As(err, &bad) {
					t.Fatalf("err = %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("got %+v, %v\nwant %+v", got, err, tc.want)
			}
		})
	}
}

func FuzzStageQuery(f *testing.F) {
	for _, s := range []string{
		"req_id=r&tokens=4&dim=8&dtype=bfloat16",
		"req_id=r&error=x",
		"req_id=r&tokens=2&dim=2&dtype=float32&source=fd&offset=4100",
		"req_id=r&tokens=4611686018427387904&dim=4&dtype=float32",
		"req_id=%zz&&;=",
		"shm=/dev/shm/../x",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, q string) {
		r, err := parseStageQuery(q)
		if err != nil {
			var bad *badRequest
			if !errors.As(err, &bad) {
				t.Fatalf("error %v is not a badRequest", err)
			}
			return
		}
		if r.ReqID == "" {
			t.Fatal("accepted an empty req_id")
		}
		if r.Error != "" {
			if r.NBytes != 0 || r.Source != "" {
				t.Fatalf("error stage with a shape: %+v", r)
			}
			return
		}
		if r.Tokens <= 0 || r.Dim <= 0 || r.Elem != elementSizes[r.Dtype] || r.NBytes <= 0 ||
			r.NBytes/r.Elem/r.Dim != r.Tokens || r.NBytes%(r.Elem*r.Dim) != 0 {
			t.Fatalf("inconsistent shape: %+v", r)
		}
		if r.Source != sourceBody && r.Source != sourceFD {
			t.Fatalf("source %q", r.Source)
		}
		if r.Offset < 0 || r.Offset+r.NBytes < 0 || (r.Source == sourceBody && r.Offset != 0) {
			t.Fatalf("unsafe offset: %+v", r)
		}
	})
}

func TestStageErrors(t *testing.T) {
	a := startAgent(t, func(c *Config) {
		c.Staging.CapacityBytes = 200
		c.Staging.MaxStageBytes = 128
	}, nil, nil)
	url := func(q string) string { return a.ctl + "/v1/stage?" + q }

	expectErr(t, a.stage(t, "short", 4, 8, "bfloat16", make([]byte, 63)), http.StatusBadRequest, "short",
		"body has 63 bytes, want tokens*dim*element_size = 4*8*2 = 64")
	expectErr(t, a.stage(t, "long", 4, 8, "bfloat16", make([]byte, 65)), http.StatusBadRequest, "long", "body has 65 bytes")
	// Without a Content-Length the body is read and counted.
	expectErr(t, do(t, http.MethodPost, url("req_id=chunk&tokens=4&dim=8&dtype=bfloat16"), io.MultiReader(bytes.NewReader(make([]byte, 10)))),
		http.StatusBadRequest, "chunk", "body has 10 bytes")
	expectErr(t, do(t, http.MethodPost, url("req_id=chunk&tokens=4&dim=8&dtype=bfloat16"), io.MultiReader(bytes.NewReader(make([]byte, 100)))),
		http.StatusBadRequest, "chunk", "body has more bytes")
	expectErr(t, a.stage(t, "dt", 4, 8, "int4", nil), http.StatusBadRequest, "dt", "unsupported dtype")
	expectErr(t, do(t, http.MethodPost, url("req_id=n&tokens=x&dim=8&dtype=bfloat16"), nil), http.StatusBadRequest, "n", "tokens must be")
	expectErr(t, do(t, http.MethodPost, url("tokens=1&dim=8&dtype=bfloat16"), nil), http.StatusBadRequest, "", "missing or invalid req_id")
	expectErr(t, a.stage(t, "big", 65, 1, "bfloat16", make([]byte, 130)), http.StatusRequestEntityTooLarge, "big", "staging.max_stage_bytes")

	a.stageOK(t, "one", 4, 8)  // 64 bytes
	a.stageOK(t, "two", 4, 16) // 128: 192 of 200 held
	expectErr(t, a.stage(t, "one", 4, 8, "bfloat16", make([]byte, 64)), http.StatusConflict, "one", "req_id=one is already staged")
	expectErr(t, do(t, http.MethodPost, url("req_id=one&error=late"), nil), http.StatusConflict, "one", "already staged")
	expectErr(t, a.stage(t, "three", 2, 2, "float32", make([]byte, 16)), http.StatusInsufficientStorage, "three",
		"would exceed staging.capacity_bytes", "192 bytes held")
	// Nothing of the refused stages was kept.
	if held, n := a.store.usage(); held != 192 || n != 2 {
		t.Fatalf("held %d bytes in %d entries, want 192 in 2", held, n)
	}
	if v := testutil.ToFloat64(a.metrics.stagedBytes); v != 192 {
		t.Fatalf("staged_bytes = %v", v)
	}
	if v := testutil.ToFloat64(a.metrics.requests.WithLabelValues("stage", "507")); v != 1 {
		t.Fatalf("requests{stage,507} = %v", v)
	}
	// The failed encodes hold no bytes, so they fit.
	expect(t, do(t, http.MethodPost, url("req_id=three&error=bad+media"), nil), http.StatusOK, `{"req_id":"three","error":"bad media"}`)
}

func TestConcurrentStagesOfOneReqID(t *testing.T) {
	a := startAgent(t, nil, nil, nil)
	const n = 8
	var wg sync.WaitGroup
	codes := make([]int, n)
	for i := range n {
		wg.Go(func() { codes[i] = a.stage(t, "same", 8, 8, "float32", make([]byte, 256)).status })
	}
	wg.Wait()
	ok := 0
	for _, c := range codes {
		switch c {
		case http.StatusOK:
			ok++
		case http.StatusConflict:
		default:
			t.Fatalf("status %d", c)
		}
	}
	if ok != 1 {
		t.Fatalf("%d stages of one req_id succeeded", ok)
	}
	if held, _ := a.store.usage(); held != 256 {
		t.Fatalf("held %d", held)
	}
}

func TestTTLSweep(t *testing.T) {
	clk := clock.NewFake(time.Unix(1_000_000, 0))
	armed := clk.TimerCreated()
	recv := startReceiver(t)
	a := startAgent(t, func(c *Config) { c.Staging.TTL = 180e9 }, clk, nil)
	<-armed // the sweeper waits on its first timer (every ttl/4 = 45s)
	advance := func(d time.Duration) {
		next := clk.TimerCreated()
		clk.Advance(d)
		<-next // the sweeper swept and armed its next timer
	}
	a.stageOK(t, "old", 2, 2)
	advance(100 * time.Second)
	if st := a.staged(t); len(st) != 1 || st[0].AgeSeconds != 100 {
		t.Fatalf("staged = %+v", st)
	}
	a.stageOK(t, "young", 2, 2)
	advance(90 * time.Second) // old is 190s old, young 90s
	st := a.staged(t)
	if len(st) != 1 || st[0].ReqID != "young" {
		t.Fatalf("staged = %+v", st)
	}
	expectErr(t, a.send(t, sendReq{id: "old", port: 1, session: recv.SessionID(), addr: base(t, recv), count: 1}),
		http.StatusInternalServerError, "old", "no staged embedding for req_id=old (already released)")
	advance(100 * time.Second)
	if st := a.staged(t); len(st) != 0 {
		t.Fatalf("staged = %+v", st)
	}
	if held, n := a.store.usage(); held != 0 || n != 0 {
		t.Fatalf("held %d bytes in %d entries", held, n)
	}
}

// memfd is a fresh memfd holding data at offset (and 100 bytes more): what
// an encoder passes for source=fd. Closed at test end.
func memfd(t *testing.T, offset int, data []byte) *os.File {
	t.Helper()
	fd, err := unix.MemfdCreate("encgate-test", unix.MFD_CLOEXEC)
	if err != nil {
		t.Skipf("memfd_create: %v", err)
	}
	f := os.NewFile(uintptr(fd), "memfd")
	t.Cleanup(func() { _ = f.Close() })
	buf := make([]byte, offset+len(data)+100)
	copy(buf[offset:], data)
	if _, err := f.Write(buf); err != nil {
		t.Fatal(err)
	}
	return f
}

func TestStageFromAPassedFile(t *testing.T) {
	recv := startReceiver(t)
	a := startAgent(t, nil, nil, nil)
	data := pattern(6*10*4, 3)
	const offset = 4096 + 17 // not page-aligned
	f := memfd(t, offset, data)
	r := a.stageFD(t, fmt.Sprintf("req_id=fd&tokens=6&dim=10&dtype=float32&source=fd&offset=%d", offset), f)
	expect(t, r, http.StatusOK, `{"req_id":"fd","embedding_size":240,"embedding_len":6,"embedding_dim":10}`)
	st := a.staged(t)
	if len(st) != 1 || st[0].Source != sourceFD || st[0].Registration != regShared || st[0].Bytes != 240 ||
		st[0].StagedBy != fmt.Sprintf("pid %d (uid %d)", os.Getpid(), os.Getuid()) {
		t.Fatalf("staged = %+v", st)
	}
	b := base(t, recv) + 512
	a.ackOK(t, "fd") // the ack may come after the embedding
	sink := startSink(t)
	expect(t, a.send(t, sendReq{id: "fd", port: sink.port, session: recv.SessionID(), addr: b, count: 1}), http.StatusOK, "null")
	sink.expectAck(t, ackFrameOf("fd"))
	got, _ := recv.Bytes(b, len(data))
	if !bytes.Equal(got, data) {
		t.Fatalf("receiver holds %x\nwant %x", got, data)
	}
	zeros(t, recv, b-512, 512)
	zeros(t, recv, b+uint64(len(data)), 512)
	if held, n := a.store.usage(); held != 0 || n != 0 {
		t.Fatalf("not unmapped on release: %d bytes in %d entries", held, n)
	}
}

func TestPassedFileTruncatedAfterStagingIsNotSent(t *testing.T) {
	recv := startReceiver(t)
	a := startAgent(t, nil, nil, nil)
	data := pattern(64<<10, 5)
	f := memfd(t, 0, data)
	r := a.stageFD(t, "req_id=cut&tokens=16&dim=1024&dtype=float32&source=fd", f)
	expect(t, r, http.StatusOK, `{"req_id":"cut","embedding_size":65536,"embedding_len":16,"embedding_dim":1024}`)
	if err := f.Truncate(0); err != nil {
		t.Fatal(err)
	}
	r = a.send(t, sendReq{id: "cut", port: 1, session: recv.SessionID(), addr: base(t, recv), count: 1})
	expectErr(t, r, http.StatusInternalServerError, "cut", "now holds 0 bytes, fewer than the 65536 staged", "nothing was sent")
	if st := recv.Stats(); st.DataConns != 0 {
		t.Fatalf("receiver saw %+v", st)
	}
}

func TestStageFromAPassedFileRefusals(t *testing.T) {
	a := startAgent(t, nil, nil, nil)
	f := memfd(t, 0, make([]byte, 16))
	wronly, err := os.OpenFile(filepath.Join(t.TempDir(), "w"), os.O_CREATE|os.O_WRONLY, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer wronly.Close()
	if _, err := wronly.Write(make([]byte, 64)); err != nil {
		t.Fatal(err)
	}
	dir, err := os.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer dir.Close()
	const q = "req_id=x&tokens=2&dim=2&dtype=float32&source=fd"
	for _, tc := range []struct {
		name  string
		query string
		file  *os.File
		want  string
	}{
		{"past the end", q + "&offset=101", f, "fewer than offset 101 + 16"},
		{"write-only", q, wronly, "not open for reading"},
		{"a directory", q, dir, "not a regular file"},
		{"no descriptor", q, nil, "no file descriptor came with the request"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			expectErr(t, a.stageFD(t, tc.query, tc.file), http.StatusBadRequest, "x", tc.want)
		})
	}
	if held, n := a.store.usage(); held != 0 || n != 0 {
		t.Fatalf("refused stages kept %d bytes in %d entries", held, n)
	}
}

// pinCounter stands in for mlock/munlock, failing pins when refuse is set.
type pinCounter struct {
	mu           sync.Mutex
	refuse       bool
	pins, unpins int
	pinned       map[*byte]int
}

func (p *pinCounter) install(a *Agent) {
	p.pinned = map[*byte]int{}
	a.pin = func(b []byte) error {
		p.mu.Lock()
		defer p.mu.Unlock()
		if p.refuse {
			return fmt.Errorf("cannot allocate memory")
		}
		p.pins++
		p.pinned[&b[0]]++
		return nil
	}
	a.unpin = func(b []byte) error {
		p.mu.Lock()
		defer p.mu.Unlock()
		p.unpins++
		p.pinned[&b[0]]--
		if p.pinned[&b[0]] < 0 {
			panic("unpinned more than pinned")
		}
		return nil
	}
}

func TestRegistrationSharedAndPerSend(t *testing.T) {
	recv := startReceiver(t)
	pc := &pinCounter{}
	a := startAgent(t, nil, nil, pc.install)
	b := base(t, recv)

	a.stageAcked(t, "shared", 4, 4)
	if st := a.staged(t); st[0].Registration != regShared {
		t.Fatalf("staged = %+v", st)
	}
	for range 2 {
		sink := startSink(t)
		expect(t, a.send(t, sendReq{id: "shared", port: sink.port, session: recv.SessionID(), addr: b, count: 2}), http.StatusOK, "null")
		sink.expectAck(t, ackFrameOf("shared"))
	}
	pc.mu.Lock()
	if pc.pins != 1 || pc.unpins != 1 {
		t.Fatalf("shared: %d pins, %d unpins; want 1 and 1 (once at staging, undone at release)", pc.pins, pc.unpins)
	}
	pc.refuse = true // as RLIMIT_MEMLOCK would
	pc.mu.Unlock()

	a.stageAcked(t, "fallback", 4, 4)
	if st := a.staged(t); st[0].Registration != regPerSend {
		t.Fatalf("staged = %+v", st)
	}
	pc.mu.Lock()
	pc.refuse = false // the per-send registration succeeds
	pc.mu.Unlock()
	for range 3 {
		sink := startSink(t)
		expect(t, a.send(t, sendReq{id: "fallback", port: sink.port, session: recv.SessionID(), addr: b, count: 3}), http.StatusOK, "null")
		sink.expectAck(t, ackFrameOf("fallback"))
	}
	pc.mu.Lock()
	if pc.pins != 4 || pc.unpins != 4 {
		t.Fatalf("per-send: %d pins, %d unpins; want 4 and 4", pc.pins, pc.unpins)
	}
	pc.mu.Unlock()
	if v := testutil.ToFloat64(a.metrics.registrations.WithLabelValues(regShared)); v != 1 {
		t.Errorf("registrations{shared} = %v", v)
	}
	if v := testutil.ToFloat64(a.metrics.registrations.WithLabelValues(regPerSend)); v != 3 {
		t.Errorf("registrations{per_send} = %v", v)
	}
}

func TestAdminStagedAndMetricsEndpoints(t *testing.T) {
	clk := clock.NewFake(time.Unix(1_000_000, 0))
	recv := startReceiver(t)
	a := startAgent(t, nil, clk, nil)
	a.stageAcked(t, "b-emb", 2, 3) // 12 bytes and a 19-byte ack frame
	expect(t, do(t, http.MethodPost, a.ctl+"/v1/stage?req_id=a-err&error=oops", nil), http.StatusOK, `{"req_id":"a-err","error":"oops"}`)
	a.ackOK(t, "c-early") // an ack frame before its embedding: 21 bytes
	sink := startSink(t)
	expect(t, a.send(t, sendReq{id: "b-emb", port: sink.port, session: recv.SessionID(), addr: base(t, recv), count: 2}), http.StatusOK, "null")
	sink.expectAck(t, ackFrameOf("b-emb"))
	clk.Advance(2 * time.Second) // the sweeper's first timer is 45s away
	r := do(t, http.MethodGet, a.admin+"/admin/staged", nil)
	me := fmt.Sprintf("pid %d (uid %d)", os.Getpid(), os.Getuid())
	want := fmt.Sprintf(`[{"req_id":"a-err","state":"failed","bytes":0,"tokens":0,"dim":0,"dtype":"","source":"","staged_by":%q,"destinations_done":[],"receive_count":0,"error":"oops","ack_frame":false,"ack_frame_bytes":0,"acks_sent":[],"sends_active":0,"age_seconds":2},`, me) +
		fmt.Sprintf(`{"req_id":"b-emb","state":"staged","bytes":12,"tokens":2,"dim":3,"dtype":"bfloat16","source":"body","staged_by":%q,"registration":"shared","destinations_done":["127.0.0.1:%d"],"receive_count":2,"ack_frame":true,"ack_frame_bytes":19,"acks_sent":["127.0.0.1:%d"],"sends_active":0,"age_seconds":2},`, me, sink.port, sink.port) +
		fmt.Sprintf(`{"req_id":"c-early","state":"ack_only","bytes":0,"tokens":0,"dim":0,"dtype":"","source":"","staged_by":%q,"destinations_done":[],"receive_count":0,"ack_frame":true,"ack_frame_bytes":21,"acks_sent":[],"sends_active":0,"age_seconds":2}]`, me)
	expect(t, r, http.StatusOK, want)

	m := do(t, http.MethodGet, a.admin+"/metrics", nil)
	for _, s := range []string{
		"encgate_agent_staged_bytes 52", "encgate_agent_staged_entries 2", "encgate_agent_transfer_bytes_total 12",
		`encgate_agent_transfers_total{result="ok"} 1`, `encgate_agent_transfers_total{result="not_allowed"} 0`,
		`encgate_agent_registrations_total{kind="shared"} 1`, `encgate_agent_registrations_total{kind="per_send"} 0`,
		`encgate_agent_requests_total{code="200",route="stage"} 2`, "encgate_agent_transfer_seconds_count 1",
		`encgate_agent_requests_total{code="200",route="ack"} 2`, `encgate_agent_acks_total{result="sent"} 1`,
		`encgate_agent_acks_total{result="failed"} 0`, `encgate_agent_acks_total{result="skipped"} 0`, "encgate_agent_ack_seconds_count 1",
	} {
		if !strings.Contains(m.body, s) {
			t.Errorf("metrics lack %q", s)
		}
	}
	expect(t, do(t, http.MethodGet, a.admin+"/healthz", nil), http.StatusOK, "ok\n")
	expect(t, do(t, http.MethodGet, a.admin+"/readyz", nil), http.StatusOK, "ready\n")
	if r := do(t, http.MethodGet, a.base+"/send", nil); r.status != http.StatusMethodNotAllowed {
		t.Errorf("GET /send: %d", r.status)
	}
	if v := testutil.ToFloat64(a.metrics.requests.WithLabelValues("other", "405")); v != 1 {
		t.Errorf("requests{other,405} = %v", v)
	}
}

func TestReceiverEndpoints(t *testing.T) {
	a := startAgent(t, func(c *Config) {
		c.Receiver = &ReceiverConfig{HandshakeListen: "127.0.0.1:0", DataListen: "127.0.0.1:0", AdvertiseHost: "127.0.0.1",
			Buffers: []configfile.ByteSize{1 << 20}}
	}, nil, nil)
	if a.Receiver() == nil {
		t.Fatal("no receiver")
	}
	r := do(t, http.MethodGet, a.base+"/v1/receiver", nil)
	var info struct {
		SessionID string `json:"session_id"`
		Buffers   []struct {
			Addr   uint64 `json:"addr"`
			Length uint64 `json:"length"`
		} `json:"buffers"`
	}
	if err := json.Unmarshal([]byte(r.body), &info); err != nil || r.status != http.StatusOK || info.SessionID != a.Receiver().SessionID() ||
		len(info.Buffers) != 1 || info.Buffers[0].Length != 1<<20 {
		t.Fatalf("GET /v1/receiver: %d %s", r.status, r.body)
	}
	// The agent sends into its own receiver.
	data := a.stageAcked(t, "self", 8, 8)
	addr := info.Buffers[0].Addr + 1000
	sink := startSink(t)
	expect(t, a.send(t, sendReq{id: "self", port: sink.port, session: info.SessionID, addr: addr, count: 1}), http.StatusOK, "null")
	sink.expectAck(t, ackFrameOf("self"))
	got := do(t, http.MethodGet, fmt.Sprintf("%s/v1/receiver/bytes?addr=%d&len=%d", a.base, addr, len(data)), nil)
	if got.status != http.StatusOK || got.body != string(data) || got.ctype != "application/octet-stream" {
		t.Fatalf("bytes: %d %q", got.status, got.body)
	}
	expectErr(t, do(t, http.MethodGet, fmt.Sprintf("%s/v1/receiver/bytes?addr=%d&len=%d", a.base, addr, 65<<20), nil),
		http.StatusBadRequest, "", "len must be")
	expectErr(t, do(t, http.MethodGet, a.base+"/v1/receiver/bytes?addr=0x10&len=1", nil), http.StatusBadRequest, "", "addr must be")
	expectErr(t, do(t, http.MethodGet, fmt.Sprintf("%s/v1/receiver/bytes?addr=%d&len=16", a.base, info.Buffers[0].Addr+1<<20), nil),
		http.StatusBadRequest, "")

	off := startAgent(t, nil, nil, nil)
	expectErr(t, do(t, http.MethodGet, off.base+"/v1/receiver", nil), http.StatusNotFound, "", "runs no receiver")
}
