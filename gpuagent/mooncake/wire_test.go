package mooncake

import (
	"bytes"
	"errors"
	"io"
	"strings"
	"testing"
)

// Golden vectors, written by hand from the reference's tables (§1.3, §1.5,
// §2.2, §9), not produced by the code under test.

func TestHeaderGolden(t *testing.T) {
	tests := []struct {
		name string
		h    Header
		wire string
	}{
		{
			name: "v1 write",
			h:    Header{Size: 4096, Addr: 0x00007f8a12345000, Opcode: 0x01},
			wire: `00 10 00 00 00 00 00 00  00 50 34 12 8a 7f 00 00  01  00 00 00 00 00 00 00`,
		},
		{
			name: "v2 write",
			h:    Header{Size: 4096, Addr: 0x00007f8a12345000, Opcode: 0x81},
			wire: `00 10 00 00 00 00 00 00  00 50 34 12 8a 7f 00 00  81  00 00 00 00 00 00 00`,
		},
		{
			name: "v1 read",
			h:    Header{Size: 0x20, Addr: 0x1122334455667788, Opcode: 0x00},
			wire: `20 00 00 00 00 00 00 00  88 77 66 55 44 33 22 11  00  00 00 00 00 00 00 00`,
		},
		{
			name: "v2 read",
			h:    Header{Size: 0x20, Addr: 0x1122334455667788, Opcode: 0x80},
			wire: `20 00 00 00 00 00 00 00  88 77 66 55 44 33 22 11  80  00 00 00 00 00 00 00`,
		},
		{
			name: "max values",
			h:    Header{Size: ^uint64(0), Addr: ^uint64(0), Opcode: 0x81},
			wire: `ff ff ff ff ff ff ff ff  ff ff ff ff ff ff ff ff  81  00 00 00 00 00 00 00`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			want := unhex(t, tt.wire)
			if got := AppendHeader(nil, tt.h); !bytes.Equal(got, want) {
				t.Fatalf("AppendHeader = % x\nwant            % x", got, want)
			}
			h, err := ParseHeader(want)
			if err != nil || h != tt.h {
				t.Fatalf("ParseHeader = %+v, %v; want %+v", h, err, tt.h)
			}
		})
	}
	if OpWrite|FlagV2 != 0x81 || OpRead|FlagV2 != 0x80 || HeaderSize != 24 {
		t.Fatal("opcode constants differ from §1.3")
	}
}

func TestParseHeaderIgnoresPadding(t *testing.T) {
	// The real initiator leaves the 7 pad bytes uninitialised (§9).
	wire := unhex(t, `08 00 00 00 00 00 00 00  00 10 00 00 00 00 00 00  81  de ad be ef 13 37 42`)
	h, err := ParseHeader(wire)
	if err != nil || h != (Header{Size: 8, Addr: 0x1000, Opcode: 0x81}) {
		t.Fatalf("ParseHeader = %+v, %v", h, err)
	}
	for _, n := range []int{0, 23, 25} {
		if _, err := ParseHeader(make([]byte, n)); err == nil {
			t.Errorf("ParseHeader of %d bytes: no error", n)
		}
	}
}

func TestStatusGolden(t *testing.T) {
	ok := unhex(t, `00 00 00 00 56 54 43 4d`)
	rej := unhex(t, `01 00 00 00 56 54 43 4d`)
	if got := AppendStatus(nil, StatusOK); !bytes.Equal(got, ok) {
		t.Errorf("AppendStatus(OK) = % x, want % x", got, ok)
	}
	if got := AppendStatus(nil, StatusAddrRejected); !bytes.Equal(got, rej) {
		t.Errorf("AppendStatus(ADDR_REJECTED) = % x, want % x", got, rej)
	}
	if st, err := ParseStatus(ok); err != nil || st != StatusOK {
		t.Errorf("ParseStatus(OK) = %d, %v", st, err)
	}
	if st, err := ParseStatus(rej); err != nil || st != StatusAddrRejected {
		t.Errorf("ParseStatus(ADDR_REJECTED) = %d, %v", st, err)
	}
	// Bytes 4-7 must be "VTCM"; a legacy peer's bytes are not.
	for _, bad := range []string{`00 00 00 00 4d 43 54 56`, `00 00 00 00 00 00 00 00`, `00 00 00 00 56 54 43 4e`} {
		if _, err := ParseStatus(unhex(t, bad)); !errors.Is(err, ErrBadMagic) {
			t.Errorf("ParseStatus(%s) = %v, want ErrBadMagic", bad, err)
		}
	}
	if _, err := ParseStatus(ok[:7]); err == nil || errors.Is(err, ErrBadMagic) {
		t.Errorf("ParseStatus of 7 bytes = %v, want a length error", err)
	}
}

// goldenMetadataRequest is a Metadata (1) frame with body "{}": length 3
// counts the type byte.
const goldenMetadataRequest = `03 00 00 00 00 00 00 00  01  7b 7d`

// goldenProbeReply is the Probe (3) reply {"status":"success"} with jsoncpp's
// trailing newline: 21 body bytes, length 22.
const goldenProbeReply = `16 00 00 00 00 00 00 00  03
	7b 22 73 74 61 74 75 73 22 3a 22 73 75 63 63 65 73 73 22 7d 0a`

func TestHandshakeFrameGolden(t *testing.T) {
	var buf bytes.Buffer
	if err := WriteFrame(&buf, HSMetadata, []byte("{}")); err != nil {
		t.Fatal(err)
	}
	if want := unhex(t, goldenMetadataRequest); !bytes.Equal(buf.Bytes(), want) {
		t.Fatalf("Metadata request = % x\nwant % x", buf.Bytes(), want)
	}
	buf.Reset()
	if err := WriteFrame(&buf, HSProbe, []byte(`{"status":"success"}`+"\n")); err != nil {
		t.Fatal(err)
	}
	if want := unhex(t, goldenProbeReply); !bytes.Equal(buf.Bytes(), want) {
		t.Fatalf("Probe reply = % x\nwant % x", buf.Bytes(), want)
	}

	typ, body, err := ReadFrame(bytes.NewReader(unhex(t, goldenProbeReply)), 0)
	if err != nil || typ != HSProbe || string(body) != `{"status":"success"}`+"\n" {
		t.Fatalf("ReadFrame(probe reply) = %d %q %v", typ, body, err)
	}
	typ, body, err = ReadFrame(bytes.NewReader(unhex(t, goldenMetadataRequest)), 0)
	if err != nil || typ != HSMetadata || string(body) != "{}" {
		t.Fatalf("ReadFrame(metadata request) = %d %q %v", typ, body, err)
	}
}

func TestReadFrameLegacy(t *testing.T) {
	// Old protocol: no type byte, the first payload byte is '{' (> 3).
	wire := unhex(t, `07 00 00 00 00 00 00 00  7b 22 61 22 3a 31 7d`) // {"a":1}
	typ, body, legacy, err := readFrame(bytes.NewReader(wire), 0)
	if err != nil || typ != HSConnection || !legacy || string(body) != `{"a":1}` {
		t.Fatalf("readFrame(legacy) = %d %q %t %v", typ, body, legacy, err)
	}
	typ, body, err = ReadFrame(bytes.NewReader(wire), 0)
	if err != nil || typ != HSConnection || string(body) != `{"a":1}` {
		t.Fatalf("ReadFrame(legacy) = %d %q %v", typ, body, err)
	}
	// A typed Connection frame whose body starts with '{' is not legacy.
	typ, body, legacy, err = readFrame(bytes.NewReader(unhex(t, `03 00 00 00 00 00 00 00 00 7b 7d`)), 0)
	if err != nil || typ != HSConnection || legacy || string(body) != "{}" {
		t.Fatalf("readFrame(typed connection) = %d %q %t %v", typ, body, legacy, err)
	}
}

// countingReader counts the bytes read through it.
type countingReader struct {
	r io.Reader
	n int
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += n
	return n, err
}

func TestReadFrameLimits(t *testing.T) {
	// Over the limit: refused after the 8 length bytes, the body unread.
	over := append(unhex(t, `01 00 10 00 00 00 00 00`), make([]byte, 64)...) // 1 MiB + 1
	cr := &countingReader{r: bytes.NewReader(over)}
	if _, _, err := ReadFrame(cr, MaxHandshakeFrame); !errors.Is(err, ErrFrameTooLarge) {
		t.Fatalf("ReadFrame(1 MiB + 1) = %v, want ErrFrameTooLarge", err)
	}
	if cr.n != 8 {
		t.Fatalf("ReadFrame read %d bytes of an oversized frame, want 8", cr.n)
	}
	// Huge lengths never allocate or wrap.
	huge := unhex(t, `ff ff ff ff ff ff ff ff 01`)
	if _, _, err := ReadFrame(bytes.NewReader(huge), 0); !errors.Is(err, ErrFrameTooLarge) {
		t.Fatalf("ReadFrame(2^64-1) = %v, want ErrFrameTooLarge", err)
	}
	// Exactly the limit is accepted.
	exact := append(unhex(t, `00 00 10 00 00 00 00 00 01`), bytes.Repeat([]byte{' '}, MaxHandshakeFrame-1)...)
	if typ, body, err := ReadFrame(bytes.NewReader(exact), MaxHandshakeFrame); err != nil || typ != HSMetadata || len(body) != MaxHandshakeFrame-1 {
		t.Fatalf("ReadFrame(exactly 1 MiB) = %d, %d bytes, %v", typ, len(body), err)
	}
	// A smaller limit applies.
	if _, _, err := ReadFrame(bytes.NewReader(unhex(t, goldenProbeReply)), 21); !errors.Is(err, ErrFrameTooLarge) {
		t.Fatalf("ReadFrame(limit 21) = %v, want ErrFrameTooLarge", err)
	}
	// Length 0 is refused.
	if _, _, err := ReadFrame(bytes.NewReader(make([]byte, 16)), 0); !errors.Is(err, errEmptyFrame) {
		t.Fatalf("ReadFrame(length 0) = %v", err)
	}
	// A body cut short is io.ErrUnexpectedEOF, a stream cut in the length too.
	if _, _, err := ReadFrame(bytes.NewReader(unhex(t, `03 00 00 00 00 00 00 00 01 7b`)), 0); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("ReadFrame(short body) = %v", err)
	}
	if _, _, err := ReadFrame(bytes.NewReader(unhex(t, `03 00 00`)), 0); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("ReadFrame(short length) = %v", err)
	}
	if _, _, err := ReadFrame(strings.NewReader(""), 0); err != io.EOF {
		t.Fatalf("ReadFrame(empty stream) = %v, want io.EOF", err)
	}
}

func TestReadBodyGrows(t *testing.T) {
	// 200 KiB: more than the first 64 KiB step, so the buffer grows twice.
	want := bytes.Repeat([]byte("0123456789abcdef"), 200<<10/16)
	got, err := readBody(bytes.NewReader(want), len(want))
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("readBody: %d bytes, %v", len(got), err)
	}
}
