package gateway

// routeKind says how the gateway handles a route.
type routeKind int

const (
	kindEncode    routeKind = iota // choose the owner by rendezvous, pin req_id
	kindFollowUp                   // go to the encoder the req_id is pinned to
	kindSend                       // kindFollowUp, deduplicated per (req_id, destination)
	kindHealth                     // answered by the gateway
	kindBroadcast                  // sent to every encoder, answers joined
)

// route is one row of DESIGN.md's route table.
type route struct {
	path  string
	label string // metric label, bounded
	kind  routeKind
	get   bool // GET allowed
	post  bool // POST allowed
}

var routes = []*route{
	{path: "/encode", label: "encode", kind: kindEncode, post: true},
	{path: "/scheduler_receive_meta_data", label: "metadata", kind: kindFollowUp, post: true},
	{path: "/scheduler_receive_url", label: "receive_url", kind: kindFollowUp, post: true},
	{path: "/send", label: "send", kind: kindSend, post: true},
	{path: "/health", label: "health", kind: kindHealth, get: true},
	{path: "/health_generate", label: "health", kind: kindHealth, get: true},
	{path: "/start_profile", label: "profile", kind: kindBroadcast, get: true, post: true},
	{path: "/stop_profile", label: "profile", kind: kindBroadcast, get: true, post: true},
}

// unknownRoute labels requests for paths the encoder does not serve.
var unknownRoute = &route{label: "unknown"}

func lookupRoute(path []byte) *route {
	for _, r := range routes {
		if string(path) == r.path {
			return r
		}
	}
	return unknownRoute
}

// routeLabels lists every label value, so metrics exist from the start.
func routeLabels() []string {
	seen := map[string]bool{}
	var out []string
	for _, r := range append(routes, unknownRoute) {
		if !seen[r.label] {
			seen[r.label] = true
			out = append(out, r.label)
		}
	}
	return out
}
