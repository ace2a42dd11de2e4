package fakeencoder

import (
	"fmt"
	"net/http"

	"github.com/valyala/fastjson"
)

// GEN1 (Options.Generation = Gen1, protocol reference §12): the encoder/
// layout as first released. Its /encode validation is partial.

// Gen1MissingModality is the 500 envelope message a GEN1 /encode without a
// modality gets: str(KeyError('modality')) (§12).
const Gen1MissingModality = "'modality'"

// Gen1InvalidModality is the format of the 500 envelope message a GEN1
// /encode with an unknown modality gets: sglang's Modality.from_str
// ValueError, "Invalid modality string…" (§12; the same text as GEN0's).
const Gen1InvalidModality = "Invalid modality string: %s. Valid modalities are: %s"

// gen1ModalityError is the 500 envelope message of a GEN1 /encode whose
// modality Modality.from_str rejects, or "".
func gen1ModalityError(mod *fastjson.Value) string {
	switch {
	case mod == nil:
		return Gen1MissingModality
	case mod.Type() != fastjson.TypeString:
		return "'" + pyTypeName(mod) + "' object has no attribute 'upper'"
	case !validModality(string(mod.GetStringBytes())):
		return fmt.Sprintf(Gen1InvalidModality, mod.GetStringBytes(), gen0Modalities)
	}
	return ""
}

// validateGen1 validates a GEN1 /encode as §12 says and answers a refused
// one itself; true if the request is accepted. A missing req_id is
// starlette's 500 text; a missing or unknown modality a 500 envelope; the
// rest is NEW's validation, 400 (§12 names IMAGE and AUDIO for the 400s of
// mm_items, num_parts / part_idx and hashes and is silent on VIDEO, which
// the fake therefore validates as NEW does).
func validateGen1(w http.ResponseWriter, req *request) bool {
	o := req.obj
	if o.Get("req_id") == nil {
		writeInternalError(w)
		return false
	}
	mod := o.Get("modality")
	if msg := gen1ModalityError(mod); msg != "" {
		writeEnvelope(w, http.StatusInternalServerError, msg, req.rawID)
		return false
	}
	if msg := validateEncode(o); msg != "" { // where §12 is silent, as NEW
		writeEnvelope(w, http.StatusBadRequest, msg, req.rawID)
		return false
	}
	return true
}
