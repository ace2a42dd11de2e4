package listener

import (
	"bytes"
	"encoding/binary"
	"net"
	"runtime"
	"sync/atomic"
)

// The framing check: every byte a client sends on the encoder-facing
// listener passes a strict reader of HTTP/1.1 message framing (RFC 9112)
// before fasthttp sees it.
//
// Why here and not in fasthttp: fasthttp unfolds obs-folded header lines
// (RFC 9112 §5.2 allows that or a 400; in front of or behind other proxies
// only the 400 cannot desync, since each parser would otherwise have to
// unfold the same way), and it reads a head that ends in bare LFs as
// incomplete until a CRLFCRLF arrives, so such a request waits out
// limits.read_header_timeout instead of getting its 400. It has no option
// for either, and by the time its HeaderReceived hook or the handler could
// look at the raw header bytes, a bare-LF head has already waited and a
// folded one has been accepted. Checking the stream underneath it answers
// both at the byte that breaks the framing.
//
// How: framingConn reads as the connection does and runs each read through
// framer. At the first byte that breaks the framing it hands fasthttp the
// bytes before it, then one NUL in place of the offending byte, and from
// then on only the error. The offending byte always lies inside a message
// (a head, a chunk line, a trailer), before the terminator that would
// complete it, so fasthttp can never complete that request: nothing of it
// reaches the handler, and so nothing reaches an encoder. The NUL makes
// sure fasthttp answers instead of closing silently: given nothing, or only
// CR and LF bytes, before an error, it treats the connection as closed by
// the client (ErrNothingRead, isOnlyCRLF) and sends no answer at all. NUL
// is invalid in every position of a request head or chunk line, so
// fasthttp's own parser refuses it too, whichever error it reports. The
// error handler (the gateway's handleReadError) then answers 400 with the reason
// recorded here and closes the connection.
//
// The framer accepts a subset of what fasthttp accepts and frames it the
// same way: a message ends where fasthttp's ends (Content-Length bytes for
// every method, chunked with trailers, no body otherwise), so the framer
// always knows where the next request starts. Every ambiguous case is
// refused rather than resolved:
//
//   - a bare LF anywhere in a head, a chunk line or a trailer (RFC 9112
//     §2.2 allows a recipient to accept it; a peer that does not frames the
//     stream differently), and a bare CR;
//   - obs-fold, and whitespace before the first header line (§5.2, §2.2);
//   - whitespace between a header name and its colon (§5.1: MUST reject),
//     and any other non-token byte in a name;
//   - control bytes, NUL included, in a head or chunk extension (fasthttp
//     refuses them too, but only once the whole head is in);
//   - both Content-Length and Transfer-Encoding (§6.3 allows rejecting; an
//     intermediary that picked the other one would desync);
//   - more than one Content-Length, even with equal values; a value that is
//     not one non-negative decimal integer;
//   - Transfer-Encoding other than one field with the single coding
//     "chunked" (identity, lists, repeats), and Transfer-Encoding on
//     HTTP/1.0 (§6.1);
//   - a version other than HTTP/1.0 and HTTP/1.1; a request line that is
//     not method SP target SP version.
//
// What fasthttp refuses by itself (a missing Host, a target that is not
// origin- or absolute-form, forbidden trailer fields, oversized heads and
// bodies) is left to it.

// framingError is why the framer refused a connection's bytes. Its reason
// is a fixed text: it never quotes the client's bytes.
type framingError struct{ reason string }

func (e *framingError) Error() string { return "malformed request framing: " + e.reason }

// The framer's refusals.
var (
	errBareLF       = &framingError{"a line ends in a bare LF, not CRLF (RFC 9112 §2.2)"}
	errBareCR       = &framingError{"a CR not followed by LF (RFC 9112 §2.2)"}
	errObsFold      = &framingError{"a header line starts with whitespace (obs-fold, RFC 9112 §5.2)"}
	errControl      = &framingError{"a control byte (NUL included) in the request head or a chunk line"}
	errRequestLine  = &framingError{"the request line is not method SP target SP version"}
	errVersion      = &framingError{"an HTTP version other than HTTP/1.0 or HTTP/1.1"}
	errFieldName    = &framingError{"a header name with a byte that is not a token character, or whitespace before its colon (RFC 9112 §5.1)"}
	errCLValue      = &framingError{"a Content-Length that is not one non-negative decimal integer"}
	errCLDuplicate  = &framingError{"more than one Content-Length header"}
	errTECoding     = &framingError{"a Transfer-Encoding other than one header with the single coding chunked"}
	errTEWithCL     = &framingError{"both Content-Length and Transfer-Encoding (RFC 9112 §6.3)"}
	errTEOnHTTP10   = &framingError{"Transfer-Encoding on an HTTP/1.0 request (RFC 9112 §6.1)"}
	errChunkFraming = &framingError{"malformed chunked framing (chunk size line, or the CRLF after chunk data)"}
)

// Framing wraps each accepted connection in a framingConn. Accept
// errors pass through unchanged.
type Framing struct{ net.Listener }

// Each Accept first yields the processor, so that the worker the server
// gave the last connection runs (reads its request, parks it if it is a
// long poll) before another connection is taken: with a backlog of
// thousands (a 504 storm's pulls arriving together) the accept loop would
// otherwise take them all first, each handed to a goroutine of its own
// that grows a request's stack before any of them runs, and the runtime
// keeps that peak's memory long after (bench/held.sh).
func (l Framing) Accept() (net.Conn, error) {
	runtime.Gosched()
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &framingConn{Conn: c}, nil
}

// framingConn is a client connection whose reads pass the framer, and
// which closes gently after an answer that cut its input short (see
// LingerOnClose).
type framingConn struct {
	net.Conn
	f      framer
	err    *framingError // set at the first violation; every later Read returns it
	linger atomic.Bool   // Close drains the client's input first
}

// Read reads from the connection and checks what it read; see the top of
// this file for what happens at a violation.
func (c *framingConn) Read(p []byte) (int, error) {
	if c.err != nil {
		return 0, c.err
	}
	n, err := c.Conn.Read(p)
	if n > 0 {
		if k, ferr := c.f.scan(p[:n]); ferr != nil {
			c.err = ferr
			p[k] = 0
			return k + 1, nil // the error comes with the next Read
		}
	}
	return n, err
}

// Fd returns the socket's descriptor (tcpconn.Conn.Fd), for the poller
// that watches a parked exchange's client.
func (c *framingConn) Fd() (int, bool) {
	if f, ok := c.Conn.(interface{ Fd() (int, bool) }); ok {
		return f.Fd()
	}
	return 0, false
}

// Close closes the connection; after LingerOnClose it first half-closes
// it and discards what the client still sends for a moment (lingerClose),
// unchecked by the framer.
func (c *framingConn) Close() error {
	if c.linger.Swap(false) {
		lingerClose(c.Conn, false)
	}
	return c.Conn.Close()
}

// LingerOnClose makes c's Close gentle, and reports whether it could: c
// is a client connection of the encoder-facing listener (Start wraps
// every one; without the wrapper the close would reset a client still
// sending).
func LingerOnClose(c net.Conn) bool {
	fc, ok := framingOf(c)
	if ok {
		fc.linger.Store(true)
	}
	return ok
}

// framingViolation returns why c's framing was refused, or nil.
func framingViolation(c net.Conn) *framingError {
	if fc, ok := framingOf(c); ok {
		return fc.err
	}
	return nil
}

// framingOf finds the framingConn under c, through wrappers that name
// the connection they wrap (NetConn, as tls.Conn does): a parked
// exchange's connection, given back with bytes to replay, is one.
func framingOf(c net.Conn) (*framingConn, bool) {
	for {
		if fc, ok := c.(*framingConn); ok {
			return fc, true
		}
		u, ok := c.(interface{ NetConn() net.Conn })
		if !ok {
			return nil, false
		}
		c = u.NetConn()
	}
}

// framer states.
const (
	stStart       uint8 = iota // before a request line: CRLFs only
	stStartLF                  // a CR before a request line; LF next
	stMethod                   // in the method
	stTarget                   // in the request target
	stVersion                  // in the version
	stLineLF                   // a CR ending the request line or a field line; LF next
	stFieldStart               // at the start of a field line, or of the empty line ending the section
	stEndLF                    // the CR of the empty line; LF next
	stName                     // in a field name
	stValue                    // in a field value
	stBody                     // in a Content-Length body
	stChunkSize                // in a chunk size
	stChunkOWS                 // whitespace after a chunk size
	stChunkExt                 // in a chunk extension
	stChunkSizeLF              // the CR ending a chunk size line; LF next
	stChunkData                // in chunk data
	stChunkDataCR              // after chunk data; CR next
	stChunkDataLF              // after chunk data's CR; LF next
)

// field kinds the framer tracks.
const (
	fieldOther uint8 = iota
	fieldCL
	fieldTE
)

// maxChunkSizeDigits is fasthttp's bound on a chunk size's hex digits on
// 64-bit platforms (maxHexIntChars): a longer size is refused here too, as
// the same request would be there.
const maxChunkSizeDigits = 15

// framer is the incremental framing reader of one connection.
type framer struct {
	st uint8

	// the message being read
	http11   bool
	haveCL   bool
	haveTE   bool
	trailers bool   // the head is done; this is the chunked body's trailer section
	remain   uint64 // bytes left of a body or a chunk

	// the request line
	ntarget int // bytes of the target so far
	ver     [8]byte
	nver    int

	// the field being read
	name   [len("transfer-encoding")]byte
	nname  int
	kind   uint8
	digits int    // Content-Length digits, or the chunk size's hex digits
	num    uint64 // their value
	owsEnd bool   // whitespace after the value (Content-Length, Transfer-Encoding)
	tePos  int    // bytes of "chunked" matched
}

// scan advances over b. At a violation it returns the offending byte's
// index and the reason.
//
// It jumps rather than stepping byte by byte where it can: over a body or
// chunk's bytes by their count, over a field value or request target to
// the end of its run (bytes.IndexByte to the CR or SP that ends it, the
// bytes before checked eight at a time, valueRun and targetRun), and over
// a method or field name by a tight loop. Every other byte (line ends,
// the version, line starts, chunk lines, Content-Length and
// Transfer-Encoding values) goes through the state machine (step, value).
// The state after each read, and every refusal and the byte it is at, are
// the same as when every byte went through step (refFramer in the tests,
// FuzzFramerDifferential).
func (f *framer) scan(b []byte) (int, *framingError) {
	i := 0
	for i < len(b) {
		switch f.st {
		case stBody, stChunkData: // opaque bytes: skip what is left of them
			n := min(uint64(len(b)-i), f.remain)
			f.remain -= n
			i += int(n)
			switch {
			case f.remain > 0:
			case f.st == stBody:
				f.endMessage()
			default:
				f.st = stChunkDataCR
			}
			continue
		case stValue:
			if f.kind == fieldOther {
				// The common case: a run of plain value bytes.
				i += valueRun(b[i:])
				if i == len(b) {
					return 0, nil
				}
			}
			if err := f.value(b[i]); err != nil {
				return i, err
			}
		case stTarget:
			n := targetRun(b[i:])
			f.ntarget += n
			i += n
			if i == len(b) {
				return 0, nil
			}
			switch c := b[i]; {
			case c == ' ' && f.ntarget > 0:
				f.st = stVersion
			case c == '\r':
				return i, errRequestLine // the line ends (or a bare CR) before its version
			case c == '\n':
				return i, errBareLF
			case isControl(c):
				return i, errControl
			default:
				return i, errRequestLine
			}
		case stMethod, stName:
			j := i
			for j < len(b) && isToken[b[j]] {
				j++
			}
			if f.st == stName {
				f.nameBytes(b[i:j])
			}
			if i = j; i == len(b) {
				return 0, nil
			}
			if err := f.step(b[i]); err != nil {
				return i, err
			}
		default:
			if err := f.step(b[i]); err != nil {
				return i, err
			}
		}
		i++
	}
	return 0, nil
}

// valueRun is the length of the run of field value bytes (isValueByte)
// that b starts with: up to the first CR, or before the first byte that is
// not a value byte.
func valueRun(b []byte) int {
	end := bytes.IndexByte(b, '\r')
	if end < 0 {
		end = len(b)
	}
	i := 0
	for ; i+8 <= end; i += 8 {
		x := binary.LittleEndian.Uint64(b[i:])
		if hasLess(x, 0x20)|hasZero(x^(lsb*0x7f)) != 0 { // a control byte, or HTAB
			for k := i; k < i+8; k++ {
				if !isValueByte[b[k]] {
					return k
				}
			}
		}
	}
	for ; i < end; i++ {
		if !isValueByte[b[i]] {
			return i
		}
	}
	return end
}

// targetRun is the length of the run of request target bytes
// (isTargetByte) that b starts with: up to the first SP, or before the
// first byte that is not a target byte.
func targetRun(b []byte) int {
	end := bytes.IndexByte(b, ' ')
	if end < 0 {
		end = len(b)
	}
	i := 0
	for ; i+8 <= end; i += 8 {
		x := binary.LittleEndian.Uint64(b[i:])
		if hasLess(x, 0x21)|hasZero(x^(lsb*0x7f)) != 0 { // a control byte
			break
		}
	}
	for ; i < end; i++ {
		if !isTargetByte[b[i]] {
			return i
		}
	}
	return end
}

// Eight bytes at a time (the classic bit tricks): whether any byte of x is
// zero, and whether any is below n (n <= 128). Both are exact as to
// whether, not as to which byte.
const lsb, msb = 0x0101010101010101, 0x8080808080808080

func hasZero(x uint64) uint64         { return (x - lsb) &^ x & msb }
func hasLess(x uint64, n byte) uint64 { return (x - lsb*uint64(n)) &^ x & msb }

// step advances over one byte in the states without a fast path.
func (f *framer) step(c byte) *framingError {
	switch f.st {
	case stStart:
		switch {
		case c == '\r':
			f.st = stStartLF
		case c == '\n':
			return errBareLF
		case isToken[c]:
			f.st = stMethod
		case isControl(c):
			return errControl
		default:
			return errRequestLine
		}
	case stStartLF:
		if c != '\n' {
			return errBareCR
		}
		f.st = stStart
	case stMethod:
		switch {
		case isToken[c]:
		case c == ' ':
			f.st = stTarget
		case c == '\r':
			return errRequestLine
		case c == '\n':
			return errBareLF
		case isControl(c):
			return errControl
		default:
			return errRequestLine
		}
	case stVersion:
		switch {
		case c == '\r':
			switch string(f.ver[:f.nver]) {
			case "HTTP/1.1":
				f.http11 = true
			case "HTTP/1.0":
				f.http11 = false
			default:
				return errVersion
			}
			f.st = stLineLF
		case c == '\n':
			return errBareLF
		case isControl(c):
			return errControl
		case f.nver == len(f.ver) || c == ' ':
			return errVersion
		default:
			f.ver[f.nver] = c
			f.nver++
		}
	case stLineLF:
		if c != '\n' {
			return errBareCR
		}
		f.st = stFieldStart
	case stFieldStart:
		// The field before this line is complete only now that this line
		// does not continue it: a folded Content-Length is refused as a
		// fold, not as the empty value before the fold.
		if c == ' ' || c == '\t' {
			return errObsFold
		}
		if err := f.endField(); err != nil {
			return err
		}
		switch {
		case c == '\r':
			f.st = stEndLF
		case c == '\n':
			return errBareLF
		case isToken[c]:
			f.st = stName
			f.nname, f.kind = 0, fieldOther
			f.nameByte(c)
		case isControl(c):
			return errControl
		default:
			return errFieldName
		}
	case stEndLF:
		if c != '\n' {
			return errBareCR
		}
		return f.endHead()
	case stName:
		switch {
		case isToken[c]:
			f.nameByte(c)
		case c == ':':
			f.classify()
			f.st = stValue
		case c == '\n':
			return errBareLF
		case isControl(c) && c != '\t' && c != '\r':
			return errControl
		default:
			return errFieldName
		}
	case stChunkSize:
		switch {
		case hexValue(c) >= 0:
			if f.digits == maxChunkSizeDigits {
				return errChunkFraming
			}
			f.num = f.num<<4 | uint64(hexValue(c))
			f.digits++
		case f.digits == 0:
			if c == '\n' {
				return errBareLF
			}
			return errChunkFraming
		case c == '\r':
			f.st = stChunkSizeLF
		case c == ' ' || c == '\t':
			f.st = stChunkOWS
		case c == ';':
			f.st = stChunkExt
		case c == '\n':
			return errBareLF
		default:
			return errChunkFraming
		}
	case stChunkOWS:
		// fasthttp accepts whitespace after the size but no extension
		// after that whitespace.
		switch c {
		case ' ', '\t':
		case '\r':
			f.st = stChunkSizeLF
		case '\n':
			return errBareLF
		default:
			return errChunkFraming
		}
	case stChunkExt:
		switch {
		case c == '\r':
			f.st = stChunkSizeLF
		case c == '\n':
			return errBareLF
		case isControl(c) && c != '\t':
			return errControl
		}
	case stChunkSizeLF:
		if c != '\n' {
			return errBareCR
		}
		if f.num == 0 {
			f.trailers = true
			f.st = stFieldStart
			return nil
		}
		f.remain = f.num
		f.st = stChunkData
	case stChunkDataCR:
		if c != '\r' {
			return errChunkFraming
		}
		f.st = stChunkDataLF
	case stChunkDataLF:
		if c != '\n' {
			return errChunkFraming
		}
		f.chunkStart()
	}
	return nil
}

// value advances over a field value byte that is not a plain byte of an
// ordinary field: the CR ending the line, a byte that is refused, or any
// byte of Content-Length and Transfer-Encoding, whose values are read.
func (f *framer) value(c byte) *framingError {
	switch {
	case c == '\r':
		f.st = stLineLF // endField runs at the next line's first byte
		return nil
	case c == '\n':
		return errBareLF
	case !isValueByte[c]:
		return errControl
	}
	switch f.kind {
	case fieldCL:
		switch {
		case c == ' ' || c == '\t':
			f.owsEnd = f.digits > 0
		case c >= '0' && c <= '9' && !f.owsEnd:
			d := uint64(c - '0')
			if f.num > (1<<63-1-d)/10 {
				return errCLValue // past fasthttp's int
			}
			f.num = f.num*10 + d
			f.digits++
		default:
			return errCLValue
		}
	case fieldTE:
		const chunked = "chunked"
		switch {
		case c == ' ' || c == '\t':
			f.owsEnd = f.tePos > 0
		case f.owsEnd || f.tePos == len(chunked) || c|0x20 != chunked[f.tePos]:
			return errTECoding
		default:
			f.tePos++
		}
	}
	return nil
}

// nameByte records a field name byte, lowercased, while the name could
// still be one the framer reads.
func (f *framer) nameByte(c byte) {
	if f.nname < len(f.name) {
		f.name[f.nname] = c | 0x20 // token bytes: only letters change
	}
	f.nname++
}

// nameBytes is nameByte for each of b's bytes.
func (f *framer) nameBytes(b []byte) {
	for k := 0; k < len(b) && f.nname+k < len(f.name); k++ {
		f.name[f.nname+k] = b[k] | 0x20
	}
	f.nname += len(b)
}

// classify decides at the colon whether the field is one that frames the
// message. Trailer fields never do (fasthttp refuses framing fields there).
func (f *framer) classify() {
	f.kind = fieldOther
	if f.trailers || f.nname > len(f.name) {
		return
	}
	switch string(f.name[:f.nname]) {
	case "content-length":
		f.kind = fieldCL
	case "transfer-encoding":
		f.kind = fieldTE
	default:
		return
	}
	f.digits, f.num, f.owsEnd, f.tePos = 0, 0, false, 0
}

// endField checks a complete Content-Length or Transfer-Encoding field.
func (f *framer) endField() *framingError {
	kind := f.kind
	f.kind = fieldOther
	switch kind {
	case fieldCL:
		switch {
		case f.digits == 0:
			return errCLValue
		case f.haveCL:
			return errCLDuplicate
		case f.haveTE:
			return errTEWithCL
		}
		f.haveCL, f.remain = true, f.num
	case fieldTE:
		switch {
		case f.tePos != len("chunked") || f.haveTE:
			return errTECoding
		case f.haveCL:
			return errTEWithCL
		case !f.http11:
			return errTEOnHTTP10
		}
		f.haveTE = true
	}
	return nil
}

// endHead starts the body the head announced, if any, after the empty line
// ending the head (or ends the message after its trailer section).
func (f *framer) endHead() *framingError {
	switch {
	case f.trailers:
		f.endMessage()
	case f.haveTE:
		f.chunkStart()
	case f.haveCL && f.remain > 0:
		f.st = stBody
	default:
		f.endMessage()
	}
	return nil
}

func (f *framer) chunkStart() {
	f.st, f.digits, f.num = stChunkSize, 0, 0
}

// endMessage readies the framer for the next request on the connection.
func (f *framer) endMessage() {
	*f = framer{}
}

// isControl reports a control byte (RFC 5234 CTL).
func isControl(c byte) bool { return c < 0x20 || c == 0x7f }

// hexValue is c's value as a hex digit, or -1.
func hexValue(c byte) int {
	switch {
	case c >= '0' && c <= '9':
		return int(c - '0')
	case c >= 'a' && c <= 'f':
		return int(c-'a') + 10
	case c >= 'A' && c <= 'F':
		return int(c-'A') + 10
	}
	return -1
}

// Byte classes: token characters (RFC 9110 §5.6.2), field value bytes
// (VCHAR, obs-text, SP, HTAB: §5.5), request target bytes (anything but
// controls and SP; the target's own syntax is fasthttp's to check).
var isToken, isValueByte, isTargetByte = func() (tok, val, tgt [256]bool) {
	for c := 0; c < 256; c++ {
		b := byte(c)
		tok[c] = b >= '0' && b <= '9' || b >= 'a' && b <= 'z' || b >= 'A' && b <= 'Z' ||
			b != 0 && bytesContain("!#$%&'*+-.^_`|~", b)
		val[c] = b == '\t' || b >= 0x20 && b != 0x7f
		tgt[c] = b > 0x20 && b != 0x7f
	}
	return
}()

func bytesContain(s string, b byte) bool {
	for i := 0; i < len(s); i++ {
		if s[i] == b {
			return true
		}
	}
	return false
}
