// Package mooncake speaks Mooncake Transfer Engine's TCP transport, in pure
// Go: the P2P handshake on a peer's RPC port (length-prefixed JSON frames that
// carry the segment descriptor), and the data port's 24-byte request header
// followed by raw bytes, with the optional v2 status frame.
//
// The Initiator writes a payload into a registered buffer of a peer named by
// its session ID ("host:rpc_port"), as Mooncake's transfer_sync_write does over
// TCP, but it checks the destination range against the peer's descriptor
// before anything is sent and it confirms delivery (v2 status frame, or
// half-close and EOF for v1 peers). The Receiver is the other side: a handshake
// port and a data port over Go-allocated buffers, for Go receivers, tests, the
// demo and benchmarks.
//
// The wire format follows shared/reference/mooncake-transfer.md (§1 and §2),
// which was checked against a real engine (§9). Every integer on the wire is
// little-endian. Nothing here authenticates a peer: bind the ports to a trusted
// network and check destinations (InitiatorConfig.Dial sees every connection
// the Initiator opens).
package mooncake
