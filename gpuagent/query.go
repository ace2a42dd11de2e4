package gpuagent

import (
	"encoding/hex"
	"fmt"
	"net/url"
	"strconv"
	"strings"

	"github.com/encgate/encgate/internal/cuda"
)

// elementSizes are the dtypes a stage may name, with their sizes in bytes
// (torch's names, as sglang's model dtypes are spelt).
var elementSizes = map[string]int64{
	"float32":       4,
	"float16":       2,
	"bfloat16":      2,
	"float8_e4m3fn": 1,
	"float8_e5m2":   1,
}

// Stage sources, the values of a stage's source parameter.
const (
	sourceBody = "body" // the request body holds the bytes (the default)
	sourceFD   = "fd"   // a file descriptor passed with the request (SCM_RIGHTS) holds them
	sourceCUDA = "cuda" // a CUDA IPC handle names device memory that holds them
)

// stageRequest is a parsed POST /v1/stage query.
type stageRequest struct {
	ReqID string
	// Error, when non-empty, records a failed encode; nothing else is set.
	Error  string
	Tokens int64  // embedding_len
	Dim    int64  // embedding_dim
	Dtype  string // a key of elementSizes
	Elem   int64  // element size in bytes
	NBytes int64  // Tokens*Dim*Elem, > 0
	// Source is sourceBody, sourceFD or sourceCUDA; with sourceFD the
	// passed file is mapped from Offset, with sourceCUDA the bytes are at
	// Offset in the allocation Handle names on Device.
	Source string
	Offset int64
	Handle cuda.IPCHandle
	Device int
}

// badRequest is a caller mistake: a 400 envelope with msg.
type badRequest struct{ msg string }

func (e *badRequest) Error() string { return e.msg }

func badf(format string, args ...any) error { return &badRequest{msg: fmt.Sprintf(format, args...)} }

var stageKeys = map[string]bool{
	"req_id": true, "error": true, "tokens": true, "dim": true, "dtype": true, "source": true, "offset": true,
	"handle": true, "device": true,
}

// parseStageQuery parses and checks a /v1/stage query string. Every key at
// most once, no unknown keys; req_id always; then either error=MSG alone, or
// tokens, dim and dtype with an optional source (body; fd with an optional
// offset; or cuda with handle, device and an optional offset).
// No parameter names a file: a file's bytes come only as
// a descriptor the stager passes over the Unix socket.
// Errors are *badRequest.
func parseStageQuery(raw string) (stageRequest, error) {
	var r stageRequest
	q, err := url.ParseQuery(raw)
	if err != nil {
		return r, badf("encgate: invalid stage query: %v", err)
	}
	for k, v := range q {
		if !stageKeys[k] {
			return r, badf("encgate: unknown stage parameter %q", k)
		}
		if len(v) != 1 {
			return r, badf("encgate: stage parameter %q given %d times", k, len(v))
		}
	}
	r.ReqID = q.Get("req_id")
	if r.ReqID == "" {
		return r, badf("missing or invalid req_id")
	}
	if q.Has("error") {
		if r.Error = q.Get("error"); r.Error == "" {
			return r, badf("encgate: error must not be empty")
		}
		for _, k := range []string{"tokens", "dim", "dtype", "source", "offset", "handle", "device"} {
			if q.Has(k) {
				return r, badf("encgate: %s cannot be given with error", k)
			}
		}
		return r, nil
	}
	if r.Tokens, err = positive(q, "tokens"); err != nil {
		return r, err
	}
	if r.Dim, err = positive(q, "dim"); err != nil {
		return r, err
	}
	r.Dtype = q.Get("dtype")
	var ok bool
	if r.Elem, ok = elementSizes[r.Dtype]; !ok {
		return r, badf("encgate: unsupported dtype %q (want float32, float16, bfloat16, float8_e4m3fn or float8_e5m2)", r.Dtype)
	}
	if r.Tokens > maxInt/r.Dim/r.Elem {
		return r, badf("encgate: tokens*dim*element_size = %d*%d*%d overflows", r.Tokens, r.Dim, r.Elem)
	}
	r.NBytes = r.Tokens * r.Dim * r.Elem
	switch r.Source = q.Get("source"); r.Source {
	case "":
		r.Source = sourceBody
	case sourceBody, sourceFD, sourceCUDA:
	default:
		return r, badf("encgate: source must be body, fd or cuda, got %q", r.Source)
	}
	if r.Source != sourceCUDA {
		for _, k := range []string{"handle", "device"} {
			if q.Has(k) {
				return r, badf("encgate: %s needs source=cuda", k)
			}
		}
	}
	if r.Source == sourceBody {
		if q.Has("offset") {
			return r, badf("encgate: offset needs source=fd or source=cuda")
		}
		return r, nil
	}
	if q.Has("offset") {
		if r.Offset, err = decimal(q.Get("offset")); err != nil {
			return r, badf("encgate: offset must be a non-negative integer, got %q", q.Get("offset"))
		}
		if r.Offset > maxInt-r.NBytes {
			return r, badf("encgate: offset+size overflows")
		}
	}
	if r.Source == sourceCUDA {
		h := q.Get("handle")
		if len(h) != 2*len(r.Handle) {
			return r, badf("encgate: handle must be the CUDA IPC memory handle as %d hex digits (cudaIpcGetMemHandle's %d bytes), got %d characters",
				2*len(r.Handle), len(r.Handle), len(h))
		}
		if _, err := hex.Decode(r.Handle[:], []byte(h)); err != nil {
			return r, badf("encgate: handle must be %d hex digits: %v", 2*len(r.Handle), err)
		}
		d, err := decimal(q.Get("device"))
		if err != nil || d > maxDevice {
			return r, badf("encgate: device must be the CUDA device ordinal (0 to %d), got %q", maxDevice, q.Get("device"))
		}
		r.Device = int(d)
	}
	return r, nil
}

// maxDevice is the largest device ordinal a stage may name.
const maxDevice = 1023

// positive parses q[key] as a decimal integer > 0.
func positive(q url.Values, key string) (int64, error) {
	s := q.Get(key)
	n, err := decimal(s)
	if err != nil || n == 0 {
		return 0, badf("encgate: %s must be a positive integer, got %q", key, s)
	}
	return n, nil
}

// decimal parses plain ASCII digits (no sign, no spaces) into an int64.
func decimal(s string) (int64, error) {
	if s == "" || strings.TrimLeft(s, "0123456789") != "" {
		return 0, strconv.ErrSyntax
	}
	return strconv.ParseInt(s, 10, 64)
}
