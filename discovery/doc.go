// Package discovery finds encoders beyond the static config and tells others
// where the gateway is.
//
// Two sources add encoders at run time: sglang's encoder bootstrap API,
// which the gateway serves so that encoders started with
// --encoder-register-urls can register themselves (Registry, with its
// Handler), and DNS, where a Kubernetes headless service lists the encoder
// pods. Each source reports Members; the gateway merges them with the YAML
// list, health-checks them and drains the ones that leave. With Redis the
// registrations are shared, so every replica sees the same set and
// rendezvous hashing agrees across them.
//
// The other direction is registration: the gateway registers itself with
// language-only sglang servers' bootstrap servers, as an encoder would, so
// they send it work without a static --encoder-urls.
package discovery
