package mooncake

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math/big"
	"net"
	"reflect"
	"strconv"
	"testing"
	"time"
	"unsafe"
)

func FuzzParseHeader(f *testing.F) {
	f.Add(unhex(f, `00 10 00 00 00 00 00 00  00 50 34 12 8a 7f 00 00  01  00 00 00 00 00 00 00`))
	f.Add(unhex(f, `00 10 00 00 00 00 00 00  00 50 34 12 8a 7f 00 00  81  00 00 00 00 00 00 00`))
	f.Add(unhex(f, `08 00 00 00 00 00 00 00  00 10 00 00 00 00 00 00  81  de ad be ef 13 37 42`))
	f.Add([]byte{})
	f.Add(make([]byte, 23))
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) > 4*HeaderSize {
			b = b[:4*HeaderSize] // longer inputs add nothing, and slow minimisation
		}
		h, err := ParseHeader(b)
		if len(b) != HeaderSize {
			if err == nil {
				t.Fatalf("%d bytes accepted", len(b))
			}
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		enc := AppendHeader(nil, h)
		if len(enc) != HeaderSize || !bytes.Equal(enc[:17], b[:17]) || !bytes.Equal(enc[17:], make([]byte, 7)) {
			t.Fatalf("AppendHeader(ParseHeader(% x)) = % x", b, enc)
		}
		if h2, err := ParseHeader(enc); err != nil || h2 != h {
			t.Fatalf("round trip %+v -> %+v, %v", h, h2, err)
		}
	})
}

func FuzzParseStatus(f *testing.F) {
	f.Add(unhex(f, `00 00 00 00 56 54 43 4d`))
	f.Add(unhex(f, `01 00 00 00 56 54 43 4d`))
	f.Add(unhex(f, `00 00 00 00 4d 43 54 56`))
	f.Add([]byte{1, 2, 3})
	f.Fuzz(func(t *testing.T, b []byte) {
		st, err := ParseStatus(b)
		if err != nil {
			return
		}
		if enc := AppendStatus(nil, st); !bytes.Equal(enc, b) {
			t.Fatalf("AppendStatus(ParseStatus(% x)) = % x", b, enc)
		}
	})
}

func FuzzReadFrame(f *testing.F) {
	f.Add(unhex(f, goldenMetadataRequest))
	f.Add(unhex(f, goldenProbeReply))
	f.Add(unhex(f, `07 00 00 00 00 00 00 00  7b 22 61 22 3a 31 7d`))
	f.Add(unhex(f, `01 00 10 00 00 00 00 00  01`))
	f.Add(unhex(f, `00 00 00 00 00 00 00 00`))
	f.Add(unhex(f, `ff ff ff ff ff ff ff ff  01`))
	f.Add(unhex(f, `01 00 00 00 00 00 00 00  02`))
	f.Fuzz(func(t *testing.T, b []byte) {
		const limit = 4096
		if len(b) > 2*limit {
			return // keeps minimisation fast; the limit is tested by size
		}
		r := bytes.NewReader(b)
		typ, body, legacy, err := readFrame(r, limit)
		if err != nil {
			if len(b) >= 8 {
				n := binary.LittleEndian.Uint64(b)
				if n > 0 && n <= limit && uint64(len(b)-8) >= n {
					t.Fatalf("a complete frame of length %d was refused: %v", n, err)
				}
			}
			return
		}
		consumed := b[:len(b)-r.Len()]
		var out bytes.Buffer
		if legacy {
			if typ != HSConnection || len(body) == 0 || body[0] <= HSProbe {
				t.Fatalf("legacy frame decoded as type %d body % x", typ, body)
			}
			_ = writeLegacyFrame(&out, body)
		} else {
			if typ > HSProbe {
				t.Fatalf("type %d", typ)
			}
			_ = WriteFrame(&out, typ, body)
		}
		if !bytes.Equal(out.Bytes(), consumed) {
			t.Fatalf("re-encoded % x, read % x", out.Bytes(), consumed)
		}
		typ2, body2, err := ReadFrame(bytes.NewReader(consumed), limit)
		if err != nil || typ2 != typ || !bytes.Equal(body2, body) {
			t.Fatalf("ReadFrame differs from readFrame")
		}
	})
}

func FuzzDecodeDescriptor(f *testing.F) {
	f.Add([]byte(refExample23))
	f.Add([]byte(refObserved9))
	f.Add([]byte(`{"name":"h:1","protocol":["tcp","hip"],"tcp_data_port":16000,"buffers":[{"name":"h:1","addr":4096,"length":100,"protocol":"tcp"},{"name":"c","addr":1,"length":1,"protocol":"hip"}]}`))
	f.Add([]byte(`{"name":"h:1","protocol":"tcp","buffers":[{"name":"h:1","addr":18446744073709551615,"length":1}]}`))
	f.Add([]byte(`{"name":"h:1","protocol":"tcp","buffers":[{"name":"","addr":4096,"length":8}]}`))
	f.Add([]byte(`{"protocol":"tcp","tcp_proto_version":-3,"tcp_data_port":65535}`))
	f.Add([]byte(`null`))
	f.Add([]byte(`{"protocol":"rdma","buffers":[{"name":"<&>","addr":0,"length":0}]}`))
	ts := time.Date(2026, 1, 2, 3, 4, 5, 6000, time.UTC)
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) > 4096 {
			return // keeps minimisation fast; size adds no new paths
		}
		d, err := DecodeDescriptor(b)
		if err != nil {
			return
		}
		_ = d.HasTCP()
		for _, buf := range d.Buffers {
			_ = d.Contains(buf.Addr, buf.Length)
			_ = d.Contains(buf.Addr+1, buf.Length)
		}
		if len(d.Protocols) != 1 {
			return // EncodeJSON writes the single-protocol form only
		}
		enc := d.encodeJSON(ts)
		d2, err := DecodeDescriptor(enc)
		if err != nil {
			t.Fatalf("re-decoding %s: %v", enc, err)
		}
		want := d
		if want.TCPProtoVersion < 2 {
			want.TCPProtoVersion = 1 // written only when >= 2
		}
		if len(want.Buffers) == 0 {
			want.Buffers = nil
		}
		if !reflect.DeepEqual(d2, want) {
			t.Fatalf("round trip\n got %+v\nwant %+v", d2, want)
		}
	})
}

// FuzzParseSessionID checks ParseSessionID against net.SplitHostPort: what
// it accepts has a host and a port in 1-65535, and the canonical form
// (net.JoinHostPort) parses back to the same.
func FuzzParseSessionID(f *testing.F) {
	for _, s := range []string{
		"10.0.0.2:16001", "[::1]:5", "host:65535", "host:65536", "host:0", ":80", "host:+80",
		"host:0080", "[fe80::1%eth0]:1", "a:b:c", "host", "[::1]", "h:-1", "h: 1",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		host, port, err := ParseSessionID(s)
		h, _, serr := net.SplitHostPort(s)
		if serr != nil {
			if err == nil {
				t.Fatalf("ParseSessionID(%q) accepted what net.SplitHostPort refuses: %v", s, serr)
			}
			return
		}
		if err != nil {
			return
		}
		if host != h || host == "" || port < 1 || port > 65535 {
			t.Fatalf("ParseSessionID(%q) = %q, %d", s, host, port)
		}
		canon := net.JoinHostPort(host, strconv.Itoa(port))
		if h2, p2, err := ParseSessionID(canon); err != nil || h2 != host || p2 != port {
			t.Fatalf("canonical %q of %q parses to %q, %d, %v", canon, s, h2, p2, err)
		}
	})
}

// fuzzBuffers reads up to 4 buffers, 16 bytes each (addr, length u64 LE).
func fuzzBuffers(b []byte) []Buffer {
	var bufs []Buffer
	for len(b) >= 16 && len(bufs) < 4 {
		bufs = append(bufs, Buffer{Addr: binary.LittleEndian.Uint64(b), Length: binary.LittleEndian.Uint64(b[8:])})
		b = b[16:]
	}
	return bufs
}

// FuzzContains checks the range check every write and read goes through
// against big-integer arithmetic: [addr, addr+size) is inside one buffer,
// size > 0, and addr+size does not pass 2^64 (reference §1.6).
func FuzzContains(f *testing.F) {
	le := func(vs ...uint64) []byte {
		var b []byte
		for _, v := range vs {
			b = binary.LittleEndian.AppendUint64(b, v)
		}
		return b
	}
	f.Add(uint64(4096), uint64(100), le(4096, 100))
	f.Add(uint64(4096), uint64(101), le(4096, 100))
	f.Add(uint64(4196), uint64(1), le(4096, 100, 4196, 50))
	f.Add(uint64(4150), uint64(100), le(4096, 100, 4196, 50))
	f.Add(uint64(1<<64-1), uint64(1), le(1<<64-16, 16))
	f.Add(uint64(1<<64-16), uint64(16), le(1<<64-16, 32))
	f.Add(uint64(5), uint64(0), le(0, 10))
	f.Add(uint64(1<<63), uint64(1<<63), le(1, 1<<64-1))
	two64 := new(big.Int).Lsh(big.NewInt(1), 64)
	f.Fuzz(func(t *testing.T, addr, size uint64, raw []byte) {
		bufs := fuzzBuffers(raw)
		a, s := new(big.Int).SetUint64(addr), new(big.Int).SetUint64(size)
		end := new(big.Int).Add(a, s)
		want := false
		if size > 0 && end.Cmp(two64) < 0 {
			for _, b := range bufs {
				bEnd := new(big.Int).Add(new(big.Int).SetUint64(b.Addr), new(big.Int).SetUint64(b.Length))
				if addr >= b.Addr && end.Cmp(bEnd) <= 0 {
					want = true
				}
			}
		}
		d := Descriptor{Buffers: bufs}
		if got := d.Contains(addr, size); got != want {
			t.Fatalf("Contains(%#x, %d) in %+v = %v, want %v", addr, size, bufs, got, want)
		}
		if i := findBuffer(bufs, addr, size); want && (i < 0 || addr < bufs[i].Addr || addr-bufs[i].Addr+size > bufs[i].Length) {
			t.Fatalf("findBuffer(%#x, %d) = %d in %+v", addr, size, i, bufs)
		}
	})
}

// streamConn is a net.Conn over an input stream, handed out at most chunk
// bytes per Read, that records what is written to it.
type streamConn struct {
	in    *bytes.Reader
	chunk int
	out   bytes.Buffer
}

func (c *streamConn) Read(b []byte) (int, error) {
	if len(b) > c.chunk {
		b = b[:c.chunk]
	}
	return c.in.Read(b)
}
func (c *streamConn) Write(b []byte) (int, error)      { return c.out.Write(b) }
func (c *streamConn) Close() error                     { return nil }
func (c *streamConn) LocalAddr() net.Addr              { return &net.TCPAddr{} }
func (c *streamConn) RemoteAddr() net.Addr             { return &net.TCPAddr{} }
func (c *streamConn) SetDeadline(time.Time) error      { return nil }
func (c *streamConn) SetReadDeadline(time.Time) error  { return nil }
func (c *streamConn) SetWriteDeadline(time.Time) error { return nil }

// FuzzReceiverData feeds a byte stream to the receiver's data-port loop and
// compares everything with a model written from reference §1.3-1.6: the
// bytes it answers, the buffer memory afterwards (the gaps and the bytes
// around the buffers included), how far it read, and its counters. The
// buffers are carved from one arena: 64 bytes at offset 0, 128 at 128 and 64
// at 256 (adjacent to the second). The first input byte picks the protocol
// version (bit 0: v1), one request per connection (bit 1) and the read size
// (bits 2-7); each header's addr in the input is relative to the arena.
func FuzzReceiverData(f *testing.F) {
	hdr := func(size, addr uint64, op uint8) []byte {
		return AppendHeader(nil, Header{Size: size, Addr: addr, Opcode: op})
	}
	cat := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	f.Add(cat([]byte{0xfc}, hdr(4, 8, OpWrite|FlagV2), []byte("abcd"), hdr(4, 8, OpRead|FlagV2)))
	f.Add(cat([]byte{0xfd}, hdr(4, 8, OpWrite), []byte("abcd"), hdr(4, 8, OpRead)))
	f.Add(cat([]byte{0x04}, hdr(16, 120, OpWrite|FlagV2), make([]byte, 16)))
	f.Add(cat([]byte{0x08}, hdr(64, 256, OpWrite|FlagV2), bytes.Repeat([]byte{9}, 64), hdr(1, 320, OpRead|FlagV2)))
	f.Add(cat([]byte{0x0c}, hdr(8, 250, OpWrite|FlagV2), []byte("spans!!!")))
	f.Add(cat([]byte{0xfc}, hdr(0, 0, OpRead|FlagV2)))
	f.Add(cat([]byte{0xfe}, hdr(2, 0, OpWrite|FlagV2), []byte("xy"), hdr(2, 2, OpWrite|FlagV2), []byte("zz")))
	f.Add(cat([]byte{0x05}, hdr(4, 128, OpRead|FlagV2)))
	f.Add(cat([]byte{0xfc}, hdr(100, 0, OpWrite|FlagV2), []byte("short")))
	f.Add(cat([]byte{0xfc}, hdr(1<<64-1, 1, OpWrite|FlagV2)))
	f.Add(cat([]byte{0xfc}, hdr(4, 0, OpWrite|FlagV2)[:20]))

	r, err := NewReceiver(ReceiverConfig{Buffers: []int{1}}, nil)
	if err != nil {
		f.Fatal(err)
	}
	arena := make([]byte, 384)
	base := uint64(uintptr(unsafe.Pointer(unsafe.SliceData(arena))))
	layout := []struct{ off, n int }{{0, 64}, {128, 128}, {256, 64}}
	r.mem, r.bufs = nil, nil
	for _, l := range layout {
		r.mem = append(r.mem, arena[l.off:l.off+l.n:l.off+l.n])
		r.bufs = append(r.bufs, Buffer{Addr: base + uint64(l.off), Length: uint64(l.n)})
	}
	two64 := new(big.Int).Lsh(big.NewInt(1), 64)
	inside := func(addr, size uint64) (int, bool) { // reference range check
		end := new(big.Int).Add(new(big.Int).SetUint64(addr), new(big.Int).SetUint64(size))
		if size == 0 || end.Cmp(two64) >= 0 {
			return 0, false
		}
		for _, l := range layout {
			b := base + uint64(l.off)
			if addr >= b && end.Cmp(new(big.Int).SetUint64(b+uint64(l.n))) <= 0 {
				return l.off + int(addr-b), true
			}
		}
		return 0, false
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		if len(in) < 1 || len(in) > 4096 {
			return
		}
		mode := in[0]
		r.cfg.ProtoVersion = 2 - int(mode&1)
		r.cfg.OneRequestPerConn = mode&2 != 0
		chunk := 1 + int(mode>>2)
		for i := range arena {
			arena[i] = byte(i*7 + 1)
		}
		model := append([]byte(nil), arena...)

		// Run the model, writing the stream the receiver gets: each header's
		// addr made absolute.
		stream := append([]byte(nil), in[1:]...)
		var want bytes.Buffer
		var writes, wbytes, rejected, reads uint64
		pos, stopped := 0, false
		for !stopped && len(stream)-pos >= HeaderSize {
			h, _ := ParseHeader(stream[pos : pos+HeaderSize])
			h.Addr += base
			copy(stream[pos:], AppendHeader(nil, h))
			pos += HeaderSize
			op, v2 := h.Opcode, false
			if r.cfg.ProtoVersion >= 2 {
				v2, op = op&FlagV2 != 0, op&^FlagV2
			}
			off, ok := inside(h.Addr, h.Size)
			if !ok {
				rejected++
				if v2 {
					want.Write(AppendStatus(nil, StatusAddrRejected))
				}
				stopped = true
				continue
			}
			if op != OpWrite {
				reads++
				if v2 {
					want.Write(AppendStatus(nil, StatusOK))
				}
				want.Write(model[off : off+int(h.Size)])
			} else {
				n := copy(model[off:off+int(h.Size)], stream[pos:])
				pos += n
				if n < int(h.Size) {
					stopped = true // cut short: what arrived is in the buffer
					continue
				}
				writes++
				wbytes += h.Size
				if v2 {
					want.Write(AppendStatus(nil, StatusOK))
				}
			}
			stopped = r.cfg.OneRequestPerConn
		}
		if !stopped {
			pos = len(stream) // a partial header is read, then the stream ends
		}

		before := r.Stats()
		c := &streamConn{in: bytes.NewReader(stream), chunk: chunk}
		r.serveData(c)
		after := r.Stats()
		if !bytes.Equal(c.out.Bytes(), want.Bytes()) {
			t.Fatalf("answered\n% x\nwant\n% x", c.out.Bytes(), want.Bytes())
		}
		if !bytes.Equal(arena, model) {
			for i := range arena {
				if arena[i] != model[i] {
					t.Fatalf("arena byte %d is %#x, want %#x", i, arena[i], model[i])
				}
			}
		}
		if read := len(stream) - c.in.Len(); read != pos {
			t.Fatalf("read %d bytes of %d, want %d", read, len(stream), pos)
		}
		if got := [4]uint64{after.Writes - before.Writes, after.Bytes - before.Bytes, after.Rejected - before.Rejected, after.Reads - before.Reads}; got != [4]uint64{writes, wbytes, rejected, reads} {
			t.Fatalf("counters (writes, bytes, rejected, reads) = %v, want %v", got, [4]uint64{writes, wbytes, rejected, reads})
		}
	})
}

// FuzzReceiverHandshake feeds one connection's bytes to the receiver's
// handshake port and checks its answer against reference §2.2: a frame of
// length 1..1 MiB (MaxHandshakeFrame, exactly, included) is answered with
// the reply for its type in the same form (typed, or legacy without a type
// byte); a length of 0, above the limit or cut short gets nothing, and a
// length above the limit is refused after its 8 length bytes, none of the
// body read. With the first input byte odd, the body is padded with zeros to
// its announced length, so lengths around 1 MiB are reachable.
func FuzzReceiverHandshake(f *testing.F) {
	frame := func(n uint64, body ...byte) []byte { return append(binary.LittleEndian.AppendUint64(nil, n), body...) }
	f.Add(append([]byte{0}, unhex(f, goldenMetadataRequest)...))
	f.Add(append([]byte{0}, frame(1, HSProbe)...))
	f.Add(append([]byte{0}, frame(3, HSNotify, '{', '}')...))
	f.Add(append([]byte{0}, frame(2, HSConnection, 'x')...))
	f.Add(append([]byte{0}, frame(7, []byte(`{"a":1}`)...)...))
	f.Add(append([]byte{1}, frame(MaxHandshakeFrame, HSMetadata)...))
	f.Add(append([]byte{1}, frame(MaxHandshakeFrame+1, HSMetadata)...))
	f.Add(append([]byte{0}, frame(0)...))
	f.Add(append([]byte{0}, frame(5, HSProbe, 1)...))
	f.Add(append([]byte{0}, frame(1<<63, HSProbe)...))
	f.Add([]byte{0, 1, 0, 0})

	r, err := NewReceiver(ReceiverConfig{Buffers: []int{64}}, nil)
	if err != nil {
		f.Fatal(err)
	}
	r.bufs[0].Name = "127.0.0.1:7" // as Start names them
	r.desc = Descriptor{Name: "127.0.0.1:7", Protocols: []string{"tcp"}, TCPDataPort: 8, TCPProtoVersion: 2, Buffers: r.bufs}
	var ev hsEvent
	r.hsHook = func(e hsEvent) { ev = e }
	f.Fuzz(func(t *testing.T, in []byte) {
		if len(in) < 1 || len(in) > 4096 {
			return
		}
		stream := in[1:]
		var n uint64
		if len(stream) >= 8 {
			n = binary.LittleEndian.Uint64(stream)
			if in[0]&1 != 0 && n <= MaxHandshakeFrame+16 && uint64(len(stream)-8) < n {
				stream = append(stream, make([]byte, n-uint64(len(stream)-8))...)
			}
		}
		c := &streamConn{in: bytes.NewReader(stream), chunk: 1 << 16}
		ev = hsEvent{}
		r.serveHandshake(c)
		out := c.out.Bytes()
		complete := len(stream) >= 8 && n >= 1 && n <= MaxHandshakeFrame && uint64(len(stream)-8) >= n
		if !complete {
			if len(out) != 0 || ev.Err == nil {
				t.Fatalf("length %d with %d bytes: answered % x, err %v", n, len(stream), out, ev.Err)
			}
			if len(stream) >= 8 && n > MaxHandshakeFrame {
				if !errors.Is(ev.Err, ErrFrameTooLarge) || c.in.Len() != len(stream)-8 {
					t.Fatalf("length %d over the limit: err %v, read %d bytes", n, ev.Err, len(stream)-c.in.Len())
				}
			}
			return
		}
		if ev.Err != nil || !ev.ClientClosed || c.in.Len() != 0 {
			t.Fatalf("event %+v, %d bytes left unread", ev, c.in.Len())
		}
		typ, legacy := stream[8], false
		if typ > HSProbe {
			typ, legacy = HSConnection, true
		}
		if ev.Type != typ || ev.Legacy != legacy {
			t.Fatalf("event %+v, want type %d legacy %v", ev, typ, legacy)
		}
		var body []byte
		if legacy {
			if len(out) < 8 || binary.LittleEndian.Uint64(out) != uint64(len(out)-8) {
				t.Fatalf("legacy reply % x", out)
			}
			body = out[8:]
		} else {
			rt, b, err := ReadFrame(bytes.NewReader(out), 0)
			if err != nil || rt != typ || 8+1+len(b) != len(out) {
				t.Fatalf("reply % x: type %d, %v", out, rt, err)
			}
			body = b
		}
		switch typ {
		case HSMetadata:
			d, err := DecodeDescriptor(body)
			if err != nil || !reflect.DeepEqual(d, r.desc) {
				t.Fatalf("metadata reply %s decodes to %+v, %v", body, d, err)
			}
		case HSProbe:
			if !bytes.Equal(body, replyProbe) {
				t.Fatalf("probe reply %q", body)
			}
		case HSNotify:
			if !bytes.Equal(body, replyNotify) {
				t.Fatalf("notify reply %q", body)
			}
		default:
			if !bytes.Equal(body, replyConnection) {
				t.Fatalf("connection reply %q", body)
			}
		}
	})
}
