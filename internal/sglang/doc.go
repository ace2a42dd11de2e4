// Package sglang is the sglang encoder's HTTP protocol as encgate speaks it,
// in one place: the route table (what each route is, how encgate routes and
// retries it, which body fields the encoder will index), the messages the
// encoder answers with, its error envelope, and the parsers of request
// bodies that encgate validates before anything is forwarded. The gateway
// and the gpuagent both read /send bodies through ParseSend, so the two can
// never disagree on what a /send is.
//
// Facts come from ../shared/reference/sglang-encoder-protocol.md (§ numbers
// below refer to it); two generations are in the field: NEW (§1-§10) and
// the older GEN0 (§11).
package sglang
