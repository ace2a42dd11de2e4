package listener

// refFramer is the framer as it was before its scan jumped over runs of
// bytes (issue 29): every byte through the state machine. It is kept, for
// tests only, as the reference the framer is compared with
// (FuzzFramerDifferential): the same state after every read, and the same
// refusal at the same byte. Its methods are the old framer's, unchanged
// but for the receiver.
type refFramer framer

// scan advances over b. At a violation it returns the offending byte's
// index and the reason.
func (f *refFramer) scan(b []byte) (int, *framingError) {
	for i := 0; i < len(b); i++ {
		c := b[i]
		switch f.st {
		case stBody, stChunkData: // opaque bytes: skip what is left of them
			n := min(uint64(len(b)-i), f.remain)
			f.remain -= n
			i += int(n) - 1
			switch {
			case f.remain > 0:
			case f.st == stBody:
				f.endMessage()
			default:
				f.st = stChunkDataCR
			}
		case stValue:
			// The common case: a run of plain value bytes.
			j := i
			for j < len(b) && isValueByte[b[j]] && f.kind == fieldOther {
				j++
			}
			if j > i {
				i = j - 1
				continue
			}
			if err := f.value(c); err != nil {
				return i, err
			}
		case stTarget:
			j := i
			for j < len(b) && isTargetByte[b[j]] {
				j++
			}
			if j > i {
				f.ntarget += j - i
				i = j - 1
				continue
			}
			switch {
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
		default:
			if err := f.step(c); err != nil {
				return i, err
			}
		}
	}
	return 0, nil
}

// step advances over one byte in the states without a fast path.
func (f *refFramer) step(c byte) *framingError {
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
func (f *refFramer) value(c byte) *framingError {
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
func (f *refFramer) nameByte(c byte) {
	if f.nname < len(f.name) {
		f.name[f.nname] = c | 0x20 // token bytes: only letters change
	}
	f.nname++
}

// classify decides at the colon whether the field is one that frames the
// message. Trailer fields never do (fasthttp refuses framing fields there).
func (f *refFramer) classify() {
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
func (f *refFramer) endField() *framingError {
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
func (f *refFramer) endHead() *framingError {
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

func (f *refFramer) chunkStart() {
	f.st, f.digits, f.num = stChunkSize, 0, 0
}

// endMessage readies the framer for the next request on the connection.
func (f *refFramer) endMessage() {
	*f = refFramer{}
}
