package mooncake

import (
	"encoding/binary"
	"fmt"
	"io"
)

// Request header (client to server on the data port), reference §1.3:
//
//	offset 0  size   u64 LE  number of payload bytes
//	offset 8  addr   u64 LE  absolute virtual address in the server process
//	offset 16 opcode u8      0 READ, 1 WRITE; ORed with 0x80 for v2
//	offset 17 pad    7 bytes sent as zeros, ignored on receipt
const HeaderSize = 24

// Opcodes. The server treats any opcode other than OpWrite (after masking
// FlagV2) as a read.
const (
	OpRead  uint8 = 0
	OpWrite uint8 = 1
	// FlagV2 asks a v2 server (descriptor tcp_proto_version >= 2) for a status
	// frame. A v1 server does not mask it, so 0x81 reads there: never send it
	// to a peer whose descriptor lacks tcp_proto_version >= 2.
	FlagV2 uint8 = 0x80
)

// Header is a decoded request header.
type Header struct {
	Size, Addr uint64
	Opcode     uint8
}

// AppendHeader appends the 24-byte encoding of h to dst, padding with zeros.
func AppendHeader(dst []byte, h Header) []byte {
	dst = binary.LittleEndian.AppendUint64(dst, h.Size)
	dst = binary.LittleEndian.AppendUint64(dst, h.Addr)
	return append(dst, h.Opcode, 0, 0, 0, 0, 0, 0, 0)
}

// ParseHeader decodes a 24-byte request header. The padding is ignored: the
// real initiator leaves it uninitialised (reference §9).
func ParseHeader(b []byte) (Header, error) {
	if len(b) != HeaderSize {
		return Header{}, fmt.Errorf("mooncake: request header of %d bytes, want %d", len(b), HeaderSize)
	}
	return Header{
		Size:   binary.LittleEndian.Uint64(b[0:8]),
		Addr:   binary.LittleEndian.Uint64(b[8:16]),
		Opcode: b[16],
	}, nil
}

// Status frame (v2, server to client), reference §1.5: bytes 0-3 are the status
// as u32 LE, bytes 4-7 the magic 56 54 43 4D (the u64 LE value
// 0x4D435456_00000000 | status).
const StatusFrameSize = 8

// Status values.
const (
	StatusOK           uint32 = 0
	StatusAddrRejected uint32 = 1
)

var statusMagic = [4]byte{0x56, 0x54, 0x43, 0x4D}

// AppendStatus appends the 8-byte status frame for status to dst.
func AppendStatus(dst []byte, status uint32) []byte {
	dst = binary.LittleEndian.AppendUint32(dst, status)
	return append(dst, statusMagic[:]...)
}

// ParseStatus decodes an 8-byte status frame. A wrong magic is ErrBadMagic.
// Status values other than StatusOK and StatusAddrRejected are returned as is.
func ParseStatus(b []byte) (uint32, error) {
	if len(b) != StatusFrameSize {
		return 0, fmt.Errorf("mooncake: status frame of %d bytes, want %d", len(b), StatusFrameSize)
	}
	if [4]byte(b[4:8]) != statusMagic {
		return 0, ErrBadMagic
	}
	return binary.LittleEndian.Uint32(b[0:4]), nil
}

// Handshake frame types (reference §2.2).
const (
	HSConnection uint8 = 0 // RDMA QP setup; the TCP engine answers an empty HandShakeDesc
	HSMetadata   uint8 = 1 // request: any JSON object; reply: the segment descriptor
	HSNotify     uint8 = 2
	HSProbe      uint8 = 3 // since v0.3.11
)

// MaxHandshakeFrame is Mooncake's default limit on a handshake frame's length
// (the type byte included). A frame of exactly this length is accepted.
const MaxHandshakeFrame = 1 << 20

// WriteFrame writes one handshake frame: a u64 LE length that counts the type
// byte, the type byte, then body, in one Write.
func WriteFrame(w io.Writer, typ uint8, body []byte) error {
	b := make([]byte, 0, 9+len(body))
	b = binary.LittleEndian.AppendUint64(b, uint64(len(body))+1)
	b = append(b, typ)
	b = append(b, body...)
	_, err := w.Write(b)
	return err
}

// writeLegacyFrame writes a frame of the old protocol, without a type byte;
// a Mooncake server answers a legacy request that way.
func writeLegacyFrame(w io.Writer, body []byte) error {
	b := make([]byte, 0, 8+len(body))
	b = binary.LittleEndian.AppendUint64(b, uint64(len(body)))
	b = append(b, body...)
	_, err := w.Write(b)
	return err
}

// ReadFrame reads one handshake frame. max (the limit on the length field,
// MaxHandshakeFrame when max <= 0) is checked before any of the body is read,
// and the body buffer grows only as bytes arrive, so a peer that announces a
// large frame and sends nothing costs no memory. A length of 0 is an error,
// one above max is ErrFrameTooLarge.
//
// A frame whose first byte after the length is above 3 (for example '{') is
// the old protocol without a type byte: it is returned as HSConnection and body
// holds every byte of the frame, that first one included.
func ReadFrame(r io.Reader, max int) (typ uint8, body []byte, err error) {
	typ, body, _, err = readFrame(r, max)
	return typ, body, err
}

// readFrame is ReadFrame that also says whether the frame was a legacy one
// (no type byte), so that a server can answer in the same form.
func readFrame(r io.Reader, max int) (typ uint8, body []byte, legacy bool, err error) {
	if max <= 0 {
		max = MaxHandshakeFrame
	}
	var lb [8]byte
	if _, err := io.ReadFull(r, lb[:]); err != nil {
		return 0, nil, false, err
	}
	n := binary.LittleEndian.Uint64(lb[:])
	switch {
	case n == 0:
		return 0, nil, false, errEmptyFrame
	case n > uint64(max):
		// n failed its check: it is not printed (it is whatever 8 bytes the
		// peer sent, "HTTP/1.1" for a web server).
		return 0, nil, false, fmt.Errorf("%w: length above the limit of %d", ErrFrameTooLarge, max)
	}
	all, err := readBody(r, int(n))
	if err != nil {
		return 0, nil, false, err
	}
	if all[0] > HSProbe {
		return HSConnection, all, true, nil
	}
	return all[0], all[1:], false, nil
}

// readBody reads exactly n bytes, growing its buffer as data arrives (64 KiB
// first, then doubling) rather than trusting n up front.
func readBody(r io.Reader, n int) ([]byte, error) {
	const first = 64 << 10
	buf := make([]byte, 0, min(n, first))
	for len(buf) < n {
		if len(buf) == cap(buf) {
			grown := make([]byte, len(buf), min(n, 2*cap(buf)))
			copy(grown, buf)
			buf = grown
		}
		m, err := io.ReadFull(r, buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+m]
		if err != nil {
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return nil, err
		}
	}
	return buf, nil
}
