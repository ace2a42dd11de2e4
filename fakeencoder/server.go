package fakeencoder

import (
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/valyala/fastjson"
)

// Route paths served by the fake.
const (
	RouteEncode       = "/encode"
	RouteSend         = "/send"
	RouteMetadata     = "/scheduler_receive_meta_data"
	RouteRegister     = "/scheduler_receive_url"
	RouteHealth       = "/health"
	RouteHealthGen    = "/health_generate"
	RouteStartProfile = "/start_profile"
	RouteStopProfile  = "/stop_profile"
	RouteStats        = "/_fake/stats"
	RouteReset        = "/_fake/reset"
	RouteFaults       = "/_fake/faults"
)

// maxBody bounds a request body.
const maxBody = 64 << 20

// defaultFailRoutes are the routes FailureRate applies to by default.
var defaultFailRoutes = []string{RouteEncode, RouteSend, RouteMetadata, RouteRegister}

// handlerFunc handles one routed request.
type handlerFunc func(e *Encoder, w http.ResponseWriter, r *http.Request, req *request)

// route is one path's allowed methods and handler.
type route struct {
	methods []string
	handle  handlerFunc
	json    bool // POST bodies are parsed as JSON (for req_id stats)
}

// routes is the encoder's FastAPI route table.
var routes = map[string]route{
	RouteEncode:       {[]string{http.MethodPost}, (*Encoder).handleEncode, true},
	RouteSend:         {[]string{http.MethodPost}, (*Encoder).handleSend, true},
	RouteMetadata:     {[]string{http.MethodPost}, (*Encoder).handleMetadata, true},
	RouteRegister:     {[]string{http.MethodPost}, (*Encoder).handleRegister, true},
	RouteHealth:       {[]string{http.MethodGet}, (*Encoder).handleHealth, false},
	RouteHealthGen:    {[]string{http.MethodGet}, (*Encoder).handleHealth, false},
	RouteStartProfile: {[]string{http.MethodGet, http.MethodPost}, (*Encoder).handleStartProfile, true},
	RouteStopProfile:  {[]string{http.MethodGet, http.MethodPost}, (*Encoder).handleStopProfile, false},
}

// parserPool recycles JSON parsers across requests.
var parserPool fastjson.ParserPool

// request is one received request with its body parsed.
type request struct {
	route    string
	body     []byte
	parser   *fastjson.Parser
	val      *fastjson.Value  // parsed body; nil if not parsed or invalid
	obj      *fastjson.Object // val as an object; nil if it is not one
	parseErr error
	idVal    *fastjson.Value // req_id; nil when absent
	rawID    []byte          // req_id as raw JSON; nil when absent
}

// id is the req_id as the key of per-request state (Python str of it).
func (q *request) id() string { return pyStr(q.idVal) }

// statsID is the req_id for Stats.ReqIDs: only string ids count.
func (q *request) statsID() string {
	if q.idVal != nil && q.idVal.Type() == fastjson.TypeString {
		return q.id()
	}
	return ""
}

// field returns a body field, or nil.
func (q *request) field(name string) *fastjson.Value {
	if q.obj == nil {
		return nil
	}
	return q.obj.Get(name)
}

// close returns the parser to the pool.
func (q *request) close() {
	if q.parser != nil {
		parserPool.Put(q.parser)
		q.parser = nil
	}
}

// enter registers a running handler; false once closed or while crashed.
func (e *Encoder) enter() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed || e.down.Load() {
		return false
	}
	e.inflight.Add(1)
	return true
}

// serveHTTP is the encoder's http.Handler.
func (e *Encoder) serveHTTP(w http.ResponseWriter, r *http.Request) {
	if !e.enter() {
		if e.down.Load() {
			panic(http.ErrAbortHandler) // a crashed encoder answers nothing
		}
		writeEmpty(w, http.StatusServiceUnavailable)
		return
	}
	defer e.inflight.Done()
	if strings.HasPrefix(r.URL.Path, "/_fake/") {
		e.serveFake(w, r)
		return
	}
	req, err := e.readRequest(r)
	if err != nil {
		writeEmpty(w, http.StatusRequestEntityTooLarge)
		return
	}
	defer req.close()
	e.countRequest(req)
	if e.crashDue(req.route) {
		e.kill() // read, never answered: the connection is reset
		return
	}
	if e.truncates(req.route) {
		rec := newRecorder()
		e.handle(rec, r, req)
		rec.sendTruncated(w)
		return
	}
	e.handle(w, r, req)
}

// handle applies the faults, then routes the request.
func (e *Encoder) handle(w http.ResponseWriter, r *http.Request, req *request) {
	if !e.applyFaults(w, r, req) {
		return
	}
	rt, ok := e.lookup(req.route)
	switch {
	case !ok:
		writeDetail(w, http.StatusNotFound, `"Not Found"`)
	case !slices.Contains(rt.methods, r.Method):
		w.Header().Set("Allow", strings.Join(rt.methods, ", "))
		writeDetail(w, http.StatusMethodNotAllowed, `"Method Not Allowed"`)
	default:
		rt.handle(e, w, r, req)
	}
}

// lookup returns path's route: GEN0 has no /scheduler_receive_meta_data.
func (e *Encoder) lookup(path string) (route, bool) {
	if e.opts.Generation == Gen0 && path == RouteMetadata {
		return route{}, false
	}
	rt, ok := routes[path]
	return rt, ok
}

// gen0 reports whether the encoder imitates GEN0.
func (e *Encoder) gen0() bool { return e.opts.Generation == Gen0 }

// readRequest reads r's body and parses it when the route takes JSON.
func (e *Encoder) readRequest(r *http.Request) (*request, error) {
	req := &request{route: r.URL.Path}
	body, err := io.ReadAll(io.LimitReader(r.Body, maxBody+1))
	if err != nil || len(body) > maxBody {
		return nil, fmt.Errorf("fakeencoder: reading body: %v", err)
	}
	req.body = body
	if rt, ok := e.lookup(req.route); !ok || !rt.json || r.Method != http.MethodPost {
		return req, nil
	}
	req.parser = parserPool.Get()
	req.val, req.parseErr = req.parser.ParseBytes(body)
	if req.parseErr != nil {
		req.val = nil
		return req, nil
	}
	if req.val.Type() == fastjson.TypeObject {
		req.obj, _ = req.val.Object()
		if req.idVal = req.obj.Get("req_id"); req.idVal != nil {
			req.rawID = marshalValue(nil, req.idVal)
		}
	}
	return req, nil
}

// requireObject answers 422 unless the body is a JSON object.
func (q *request) requireObject(w http.ResponseWriter) bool {
	if q.obj != nil {
		return true
	}
	write422(w, q.body, q.val, q.parseErr)
	return false
}

// applyFaults applies Latency, Hang and FailureRate in that order. It
// reports whether normal handling should go on.
func (e *Encoder) applyFaults(w http.ResponseWriter, r *http.Request, req *request) bool {
	f := e.Faults()
	ctx := r.Context()
	if f.Latency > 0 && !e.sleep(ctx, req.route, f.Latency) {
		return false
	}
	if f.Hang {
		e.sleep(ctx, req.route, -1)
		return false
	}
	if f.FailureRate <= 0 {
		return true
	}
	if !e.onRoutes(f.FailRoutes, req.route) || !e.roll(f.FailureRate) {
		return true
	}
	status, msg := f.FailStatus, f.FailMessage
	if status == 0 {
		status = DefaultFailStatus
	}
	if msg == "" {
		msg = DefaultFailMessage
	}
	writeEnvelope(w, status, msg, req.rawID)
	return false
}

// roll reports whether a fault with probability p fires.
func (e *Encoder) roll(p float64) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.opts.Rand() < p
}

// handleHealth answers GET /health and /health_generate: an empty 200, or
// 503 with HealthFail or the failing turns of HealthFlap, or nothing with
// HealthHang.
func (e *Encoder) handleHealth(w http.ResponseWriter, r *http.Request, req *request) {
	f := e.Faults()
	switch {
	case f.HealthHang:
		e.sleep(r.Context(), req.route, -1)
	case f.HealthFail, e.healthFlapFails():
		writeEmpty(w, http.StatusServiceUnavailable)
	default:
		writeEmpty(w, http.StatusOK)
	}
}

// profileState is the EncoderProfiler state.
type profileState struct {
	initialized bool // an EncoderProfiler exists (a start was seen)
	running     bool
}

// handleStartProfile answers /start_profile with sglang's text responses.
func (e *Encoder) handleStartProfile(w http.ResponseWriter, _ *http.Request, req *request) {
	dir := "/tmp"
	if len(strings.TrimSpace(string(req.body))) > 0 {
		if req.val == nil || (req.obj == nil && req.val.Type() != fastjson.TypeNull) {
			write422(w, req.body, req.val, req.parseErr)
			return
		}
		if d := req.field("output_dir"); d != nil && len(d.GetStringBytes()) > 0 {
			dir = string(d.GetStringBytes())
		}
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	e.profile.initialized = true
	if e.profile.running {
		writeText(w, http.StatusBadRequest, "profiling already running")
		return
	}
	e.profile.running = true
	id := pyFloat(unixFloat(time.Now()))
	writeText(w, http.StatusOK, "Start profiling. output_dir="+dir+" profile_id="+id+"\n")
}

// handleStopProfile answers /stop_profile with sglang's text responses.
func (e *Encoder) handleStopProfile(w http.ResponseWriter, _ *http.Request, _ *request) {
	e.mu.Lock()
	defer e.mu.Unlock()
	switch {
	case !e.profile.initialized:
		writeText(w, http.StatusBadRequest, "profiling not initialized\n")
	case !e.profile.running:
		writeText(w, http.StatusBadRequest, "profiling not running")
	default:
		e.profile.running = false
		writeText(w, http.StatusOK, "Stop profiling.\n")
	}
}
