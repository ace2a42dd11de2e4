// Package fleet is the gateway's list of encoders and what keeps it
// current: the config file's encoders (static), registrations through
// sglang's bootstrap API (served here, its registry in memory, in a state
// file or in Redis), DNS discovery, and the gateway's own registration with
// sglang bootstrap servers. Fleet merges the sources (a name or URL seen
// twice is one encoder: the file's entry wins, then a registration, then
// DNS), keeps the gateway's own addresses out (selfguard.go), drains the
// encoders that leave every source, and feeds the merged list to the
// upstream pool on every change.
//
// The package finds encoders through package discovery and hands them to
// package upstream; it knows nothing of the request path, which is the
// gateway's.
package fleet
