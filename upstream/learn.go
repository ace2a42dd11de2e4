package upstream

import (
	"bytes"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/encgate/encgate/internal/sglang"
)

// What the gateway learns of each encoder from its answers (protocol
// reference §11, §12): sglang generations answer the same route
// differently after the same failure, and an operator rarely knows which
// generation a fleet runs (a rolling upgrade runs two at once). A fact not
// learned yet is unknown, and the gateway then acts so that every
// generation is served; EncoderConfig.Generation overrides what is learned.
// A dial failure forgets everything: whatever answers next at that URL is
// a new process, perhaps of another generation.

// Fact is one learned yes/no, or unknown.
type Fact uint32

// Facts.
const (
	Unknown Fact = iota
	Yes
	No
)

var factNames = [...]string{"unknown", "yes", "no"}

func (f Fact) String() string { return enumName(factNames[:], int(f), "fact") }

// MarshalText shows a fact as its name.
func (f Fact) MarshalText() ([]byte, error) { return []byte(f.String()), nil }

// UnmarshalText reads a fact's name.
func (f *Fact) UnmarshalText(b []byte) error {
	for i, n := range factNames {
		if n == string(b) {
			*f = Fact(i)
			return nil
		}
	}
	return fmt.Errorf("unknown fact %q", b)
}

// learned holds an encoder's facts; each is read and written atomically.
type learned struct {
	// failedRegistration: does the encoder take a registration for a part
	// whose /encode it failed at once (Yes: GEN0, GEN1 non-DP, which push
	// their error frame to it) or hold it (No: NEW; GEN1 DP answers 404
	// only after its mapping wait)?
	failedRegistration atomic.Uint32
	// rankDedupe: does it dedupe the receiver ranks' own /encodes of a
	// part (GEN0: a sibling of a failed first call gets "Encode failed on
	// the first request")?
	rankDedupe atomic.Uint32
	// metadataRoute: does it serve /scheduler_receive_meta_data (GEN0 has
	// no such route: starlette's 404 Not Found)?
	metadataRoute atomic.Uint32
	// dp: does it answer as a DP encoder (GEN1's "Encoder DP rank=R ...
	// timed out", "Unknown req_id")?
	dp atomic.Uint32
	// since is when the first of the current facts was learned (unix
	// nanoseconds; 0: none).
	since atomic.Int64
	// forgotten counts the times a dial failure made it forget.
	forgotten atomic.Uint64
}

func (l *learned) set(f *atomic.Uint32, v Fact, now time.Time) {
	if Fact(f.Swap(uint32(v))) != v {
		l.since.CompareAndSwap(0, now.UnixNano())
	}
}

// forget drops every fact.
func (l *learned) forget() {
	if l.since.Load() == 0 {
		return
	}
	for _, f := range []*atomic.Uint32{&l.failedRegistration, &l.rankDedupe, &l.metadataRoute, &l.dp} {
		f.Store(uint32(Unknown))
	}
	l.since.Store(0)
	l.forgotten.Add(1)
}

// LearnedView is what /admin/upstreams shows of an encoder's facts.
type LearnedView struct {
	// Override is encoders[].generation when set: it decides the failed
	// registration path instead of the learned fact.
	Override string `json:"generation_override,omitempty"`
	// TakesFailedRegistration: yes, it takes at once a registration for a
	// part whose /encode it failed (and pushes its error frame); no, it
	// holds one.
	TakesFailedRegistration Fact `json:"takes_failed_registration"`
	DedupesRankEncodes      Fact `json:"dedupes_rank_encodes"`
	ServesMetadata          Fact `json:"serves_metadata"`
	DP                      Fact `json:"dp"`
	// Guess is the sglang generation the facts point to: gen0, gen1, new,
	// or "" while they point to none.
	Guess     string    `json:"generation_guess,omitempty"`
	Since     time.Time `json:"since,omitzero"`
	Forgotten uint64    `json:"forgotten"`
}

// Learned returns what the gateway has learned of e.
func (e *Encoder) Learned() LearnedView {
	l := &e.learned
	v := LearnedView{Override: string(e.Generation()),
		TakesFailedRegistration: Fact(l.failedRegistration.Load()), DedupesRankEncodes: Fact(l.rankDedupe.Load()),
		ServesMetadata: Fact(l.metadataRoute.Load()), DP: Fact(l.dp.Load()), Forgotten: l.forgotten.Load()}
	if ns := l.since.Load(); ns != 0 {
		v.Since = time.Unix(0, ns).UTC()
	}
	switch {
	case v.ServesMetadata == No || v.DedupesRankEncodes == Yes:
		v.Guess = string(Gen0)
	case v.DP == Yes, v.TakesFailedRegistration == Yes && v.ServesMetadata == Yes:
		v.Guess = string(Gen1)
	case v.TakesFailedRegistration == No && v.DP != Yes:
		v.Guess = string(GenNew)
	}
	return v
}

// forwardsFailedRegistration says whether a registration for a part whose
// /encode e failed goes to e: by the override, else unless e was learned
// to hold one.
func (e *Encoder) forwardsFailedRegistration() bool {
	switch e.Generation() {
	case GenNew:
		return false
	case Gen0, Gen1:
		return true
	}
	return Fact(e.learned.failedRegistration.Load()) != No
}

// notFound is starlette's answer for a route the app does not have.
var notFound = []byte(`{"detail":"Not Found"}`)

// learn reads what one answered exchange of rt tells of e's behaviour.
func (e *Encoder) learn(rt *sglang.Route, v *Verdict, body []byte, now time.Time) {
	l := &e.learned
	if v.Kind == KindDialFailed {
		l.forget()
		return
	}
	if v.Kind != KindAnswered {
		return
	}
	switch {
	case rt == sglang.RouteMetadata && v.Status == 200:
		l.set(&l.metadataRoute, Yes, now)
	case rt == sglang.RouteMetadata && v.Status == 404 && bytes.Equal(bytes.TrimSpace(body), notFound):
		l.set(&l.metadataRoute, No, now)
	}
	switch {
	case v.Status == 500 && rt.Kind == sglang.KindEncode && bytes.Contains(body, []byte(sglang.EncodeFailedFirst)):
		l.set(&l.rankDedupe, Yes, now)
	case v.Status >= 400 && bytes.Contains(body, []byte(sglang.DPRankPrefix)),
		v.Status == 404 && bytes.Contains(body, []byte(sglang.UnknownReqID)):
		l.set(&l.dp, Yes, now)
	}
}
