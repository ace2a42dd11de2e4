package sglang

// Messages the encoder answers with (§3), as encgate matches them. Where a
// message carries the req_id or other text, the constant is the part that
// is always there.
const (
	// MetadataNotReady is the 504 of a metadata pull whose wait ran out
	// (§5): the part's /encode never reached this encoder, or is slow.
	MetadataNotReady = "encode metadata not ready"
	// DPWorkersDead is the 503 of an encoder with no live DP worker: the
	// /encode was not taken, so it may go to the next encoder.
	DPWorkersDead = "All encoder DP workers are dead."
	// EncodeFailedFirst is GEN0's 500 to the sibling ranks of a part whose
	// first /encode failed (§11): caused by that failure, not by the
	// encoder's health.
	EncodeFailedFirst = "Encode failed on the first request"
	// AlreadyReleased ends the /send answer for a req_id with no staged
	// state, non-DP and DP alike (§3).
	AlreadyReleased = "(already released)"
	// RequestReleased is the /send answer once the request was marked
	// released (a sibling failed, or the sweep ran).
	RequestReleased = "Encoder request was released"
	// NoEmbedding is the /send answer after the part's encode failed.
	NoEmbedding = "No embedding available for Mooncake GPU-direct transfer"
	// RequestNotStarted is NEW's 504 to a registration whose /encode never
	// came.
	RequestNotStarted = "Timed out waiting for encoder request to start"
	// TransferFailed starts the /send answer when the RDMA write failed:
	// about the destination at least as often as about the encoder.
	TransferFailed = "Mooncake transfer_sync failed"
	// InternalServerError is starlette's text/plain 500 for an exception
	// outside the handlers' try blocks: a KeyError on a missing field or an
	// unknown req_id, GEN0's failed assert on a changed receive_count.
	InternalServerError = "Internal Server Error"
	// BatchTimedOut is the 504 of an /encode whose batch outlived the
	// encoder's watchdog.
	BatchTimedOut = "encoder batch timed out"
)

// AlreadyReleasedMessage is the encoder's non-DP /send answer for a req_id
// it holds no state for.
func AlreadyReleasedMessage(reqID string) string {
	return "no staged embedding for req_id=" + reqID + " " + AlreadyReleased
}

// DPRankPrefix starts a GEN1 DP encoder's timeouts (§12): "Encoder DP
// rank=R timed out after Xs" (an /encode), "Encoder DP rank=R metadata
// wait timed out after Xs" (a metadata pull).
const DPRankPrefix = "Encoder DP rank="

// DPMetadataTimedOut is in a GEN1 DP encoder's 504 to a metadata pull
// whose wait ran out: the same "not ready yet" as MetadataNotReady.
const DPMetadataTimedOut = "metadata wait timed out"

// UnknownReqID is a DP encoder's answer for a req_id no rank knows (404 on
// the waits, 500 text on /send).
const UnknownReqID = "Unknown req_id"

// ReceiverNotTold is in encgate's gpuagent's /send answer when the bytes
// reached the receiver's buffer but its ack (or completion notice) could
// not be delivered: about the receiver, not the encoder.
const ReceiverNotTold = "so the receiver will not know"

// Preprocessing failures on the request's own media (§3): NEW answers 500
// for exceptions other than TypeError/ValueError, both generations for a
// NotImplementedError. An encoder whose processor is broken for every input
// fails its /health probe (a dummy encode) too.
const (
	PreprocessFailed = "Failed to process mm items"
	NotImplemented   = "Not implemented error"
)
