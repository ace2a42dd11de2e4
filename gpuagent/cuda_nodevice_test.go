package gpuagent

import (
	"fmt"
	"net/http"
	"path/filepath"
	"strings"
	"testing"

	"go.uber.org/zap"
)

// handleHex is a well-formed (but unknown) IPC handle.
var handleHex = strings.Repeat("ab", 64)

func (a *testAgent) stageCUDA(t *testing.T, id string, tokens, dim int, device int, handle string, offset int64) reply {
	t.Helper()
	q := fmt.Sprintf("%s/v1/stage?req_id=%s&tokens=%d&dim=%d&dtype=bfloat16&source=cuda&device=%d&handle=%s", a.ctl, id, tokens, dim, device, handle)
	if offset != 0 {
		q += fmt.Sprintf("&offset=%d", offset)
	}
	return do(t, http.MethodPost, q, nil)
}

// Without a CUDA driver (a library that is not there) or with cuda.mode
// off, a stage by handle is refused with 501 naming why, nothing is
// reserved, and staging bytes and /send work as before.
func TestStageByHandleWithoutCUDAIsRefusedNamingWhy(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "libcuda-not-here.so.1")
	for _, tc := range []struct {
		name   string
		mutate func(*Config)
		why    string
	}{
		{"no library", func(c *Config) { c.CUDA.Library = missing }, "libcuda-not-here.so.1"},
		{"mode off", func(c *Config) { c.CUDA.Mode = CUDAOff }, "cuda.mode is off in this agent's config"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			recv := startReceiver(t)
			a := startAgent(t, func(c *Config) { tc.mutate(c); c.Ack.Mode = AckOff }, nil, nil)
			expectErr(t, a.stageCUDA(t, "req-gpu", 4, 8, 0, handleHex, 0), http.StatusNotImplemented, "req-gpu",
				"cannot stage by CUDA IPC handle (source=cuda) on device 0", tc.why, "stage the bytes instead")
			if held, n := a.store.usage(); held != 0 || n != 0 {
				t.Fatalf("a refused stage left %d bytes in %d entries", held, n)
			}
			data := a.stageOK(t, "req-gpu", 4, 8) // the same req_id, staged as bytes
			addr := base(t, recv)
			expect(t, a.send(t, sendReq{id: "req-gpu", port: 9, session: recv.SessionID(), addr: addr, count: 1}), http.StatusOK, "null")
			got, _ := recv.Bytes(addr, len(data))
			if string(got) != string(data) {
				t.Fatal("the bytes staged after the refusal did not arrive")
			}
		})
	}
}

// cuda.mode required refuses to start without a usable driver, naming why.
func TestCUDARequiredRefusesToStartWithoutADriver(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Listen, cfg.AdminListen = "127.0.0.1:0", "127.0.0.1:0"
	cfg.Control.Socket, cfg.Control.Token = socketPath(t), testToken
	cfg.CUDA.Mode, cfg.CUDA.Library = CUDARequired, filepath.Join(t.TempDir(), "nolib.so")
	_, err := New(cfg, Deps{Log: zap.NewNop()})
	if err == nil || !strings.Contains(err.Error(), "cuda.mode is required, but CUDA cannot be used") ||
		!strings.Contains(err.Error(), "nolib.so") {
		t.Fatalf("New = %v, want a refusal naming the library", err)
	}
}

// The stage-by-handle query is checked before anything else: the handle's
// length and digits, the device ordinal, and handle/device only with
// source=cuda.
func TestStageByHandleQueryRefusals(t *testing.T) {
	a := startAgent(t, func(c *Config) { c.CUDA.Mode = CUDAOff }, nil, nil)
	base := a.ctl + "/v1/stage?req_id=q&tokens=4&dim=8&dtype=bfloat16"
	for _, tc := range []struct{ query, want string }{
		{"&source=cuda&device=0&handle=abcd", "handle must be the CUDA IPC memory handle as 128 hex digits (cudaIpcGetMemHandle's 64 bytes), got 4 characters"},
		{"&source=cuda&device=0&handle=" + strings.Repeat("zz", 64), "handle must be 128 hex digits"},
		{"&source=cuda&handle=" + handleHex, `device must be the CUDA device ordinal (0 to 1023), got ""`},
		{"&source=cuda&device=-1&handle=" + handleHex, `device must be the CUDA device ordinal (0 to 1023), got "-1"`},
		{"&source=cuda&device=1024&handle=" + handleHex, "device must be the CUDA device ordinal"},
		{"&handle=" + handleHex, "handle needs source=cuda"},
		{"&source=fd&device=0", "device needs source=cuda"},
		{"&offset=4", "offset needs source=fd or source=cuda"},
		{"&source=gpu", "source must be body, fd or cuda"},
	} {
		expectErr(t, do(t, http.MethodPost, base+tc.query, nil), http.StatusBadRequest, "q", tc.want)
	}
}
