package sglang

// Kind says how encgate handles a route.
type Kind uint8

// Route kinds.
const (
	// KindUnknown is a path the encoder does not serve.
	KindUnknown Kind = iota
	// KindEncode places a part on an encoder and pins its req_id there.
	KindEncode
	// KindFollowUp goes to the encoder that holds the req_id.
	KindFollowUp
	// KindSend is a follow-up deduplicated per (req_id, destination).
	KindSend
	// KindHealth is answered by encgate for the fleet.
	KindHealth
	// KindBroadcast goes to every encoder; the answers are joined.
	KindBroadcast
)

// Route labels: metric label values and the names of retry policies
// (retry.<label> in the gateway's config).
const (
	LabelEncode     = "encode"
	LabelMetadata   = "metadata"
	LabelReceiveURL = "receive_url"
	LabelSend       = "send"
	LabelHealth     = "health"
	LabelProfile    = "profile"
	LabelUnknown    = "unknown"
)

// Route is one row of the encoder's route table.
type Route struct {
	Path  string
	Label string
	Kind  Kind
	GET   bool // GET (and HEAD) allowed
	POST  bool
	// LongPoll marks a route the encoder holds by design, waiting for
	// another request (a metadata pull waits for the part's encode, a
	// registration for its /encode; both up to REQ_TIMEOUT, 180 s): a try
	// that runs out of time says nothing about the encoder's health.
	LongPoll bool
	// Needs names the body fields the encoder indexes with [] (a KeyError
	// when absent): encgate refuses a body without them, or with one of the
	// wrong type, before anything is forwarded.
	Needs []string

	parse func(body []byte, lim Limits) (Request, *FieldError)
}

// Parse reads and validates a request body for r within lim. A
// *FieldError names the problem; the caller answers it 400 and forwards
// nothing.
func (r *Route) Parse(body []byte, lim Limits) (Request, *FieldError) {
	if r.parse == nil {
		return Request{}, nil
	}
	return r.parse(body, lim)
}

// Paths of the routes the encoder serves (§1).
const (
	PathEncode         = "/encode"
	PathMetadata       = "/scheduler_receive_meta_data"
	PathReceiveURL     = "/scheduler_receive_url"
	PathSend           = "/send"
	PathHealth         = "/health"
	PathHealthGenerate = "/health_generate"
	PathStartProfile   = "/start_profile"
	PathStopProfile    = "/stop_profile"
)

// The routes the encoder serves (§1).
var (
	RouteEncode = &Route{Path: PathEncode, Label: LabelEncode, Kind: KindEncode, POST: true,
		Needs: []string{"req_id", "mm_items", "modality", "num_parts", "part_idx"}, parse: parseEncode}
	RouteMetadata = &Route{Path: PathMetadata, Label: LabelMetadata, Kind: KindFollowUp, POST: true,
		LongPoll: true, Needs: []string{"req_id", "part_idx"}, parse: parseMetadata}
	RouteReceiveURL = &Route{Path: PathReceiveURL, Label: LabelReceiveURL, Kind: KindFollowUp, POST: true,
		LongPoll: true, Needs: []string{"req_id", "receive_url", "receive_count"}, parse: parseReceiveURL}
	// Send is long-poll as well: the encoder waits for the part's embedding
	// without a timeout (§4 step 3), so a /send that outlives its try is
	// waiting on the encode, which /encode's own verdict judges.
	RouteSend = &Route{Path: PathSend, Label: LabelSend, Kind: KindSend, POST: true, LongPoll: true,
		Needs: []string{"req_id", "prefill_host", "embedding_port", "session_id", "buffer_address"}, parse: parseSendRoute}
	RouteHealth         = &Route{Path: PathHealth, Label: LabelHealth, Kind: KindHealth, GET: true}
	RouteHealthGenerate = &Route{Path: PathHealthGenerate, Label: LabelHealth, Kind: KindHealth, GET: true}
	RouteStartProfile   = &Route{Path: PathStartProfile, Label: LabelProfile, Kind: KindBroadcast, GET: true, POST: true}
	RouteStopProfile    = &Route{Path: PathStopProfile, Label: LabelProfile, Kind: KindBroadcast, GET: true, POST: true}
	// RouteUnknown stands for every other path.
	RouteUnknown = &Route{Label: LabelUnknown, Kind: KindUnknown}
)

// Routes lists the served routes in table order.
var Routes = []*Route{RouteEncode, RouteMetadata, RouteReceiveURL, RouteSend, RouteHealth, RouteHealthGenerate, RouteStartProfile, RouteStopProfile}

// Lookup returns the route for path, or RouteUnknown.
func Lookup(path []byte) *Route {
	for _, r := range Routes {
		if string(path) == r.Path {
			return r
		}
	}
	return RouteUnknown
}

// MaxFanout bounds the k of a fan-out prefix /p/<k>/.
const MaxFanout = 1024

// StripFanout returns path without a fan-out prefix "/p/<k>" (k a decimal
// below MaxFanout, without leading zeros), and path unchanged when it has
// none. sglang's language server sends one part per modality to each
// encoder URL it knows and dedupes the URLs, so a gateway it knows as
// base/p/0 … base/p/7 gets eight-way fan-out; every route is served under
// each prefix as without it.
func StripFanout(path []byte) []byte {
	const pre = "/p/"
	if len(path) < len(pre)+2 || string(path[:len(pre)]) != pre {
		return path
	}
	rest := path[len(pre):]
	k, n := 0, 0
	for n < len(rest) && rest[n] >= '0' && rest[n] <= '9' {
		k = k*10 + int(rest[n]-'0')
		n++
		if k >= MaxFanout {
			return path
		}
	}
	if n == 0 || n >= len(rest) || rest[n] != '/' || n > 1 && rest[0] == '0' {
		return path
	}
	return rest[n:]
}

// Labels lists every label value once (RouteUnknown's included), so metrics can
// exist from the start.
func Labels() []string {
	var out []string
	seen := map[string]bool{}
	for _, r := range append(append([]*Route{}, Routes...), RouteUnknown) {
		if !seen[r.Label] {
			seen[r.Label] = true
			out = append(out, r.Label)
		}
	}
	return out
}

// RetryLabels are the labels of the routes that have a retry policy.
var RetryLabels = []string{LabelMetadata, LabelReceiveURL, LabelEncode, LabelSend}

// Allow is the Allow header for a 405 on r.
func (r *Route) Allow() string {
	switch {
	case r.GET && r.POST:
		return "GET, HEAD, POST"
	case r.GET:
		return "GET, HEAD"
	default:
		return "POST"
	}
}
