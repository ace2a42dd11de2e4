package mooncake

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"strings"
	"testing"
	"time"
)

// hsEvents installs a handshake hook that reports on a channel.
func hsEvents(r *Receiver) <-chan hsEvent {
	ch := make(chan hsEvent, 16)
	r.hsHook = func(ev hsEvent) { ch <- ev }
	return ch
}

func TestHandshakeProbeReplyGolden(t *testing.T) {
	r := startReceiver(t, ReceiverConfig{Buffers: []int{4096}}, nil)
	c := rawDial(t, r.SessionID())
	if err := WriteFrame(c, HSProbe, []byte("{}")); err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(c) // the server half-closes after its reply
	if err != nil {
		t.Fatal(err)
	}
	if want := unhex(t, goldenProbeReply); !bytes.Equal(got, want) {
		t.Fatalf("probe reply % x\nwant        % x", got, want)
	}
}

func TestHandshakeReplies(t *testing.T) {
	r := startReceiver(t, ReceiverConfig{Buffers: []int{4096}}, nil)
	tests := []struct {
		typ  uint8
		want string
	}{
		{HSNotify, `{"name":"","notify_msg":"success"}` + "\n"},
		{HSConnection, `{"local_gid":"","local_lid":0,"local_nic_path":"","payload":"","peer_nic_path":"","qp_num":[],"reply_msg":""}` + "\n"},
	}
	for _, tt := range tests {
		c := rawDial(t, r.SessionID())
		if err := WriteFrame(c, tt.typ, []byte(`{"name":"x","notify_msg":"y"}`)); err != nil {
			t.Fatal(err)
		}
		typ, body, err := ReadFrame(c, 0)
		if err != nil || typ != tt.typ || string(body) != tt.want {
			t.Fatalf("type %d: reply %d %q %v", tt.typ, typ, body, err)
		}
		_ = c.Close()
	}

	// Metadata: a real initiator sends its own descriptor, which is ignored.
	c := rawDial(t, r.SessionID())
	if err := WriteFrame(c, HSMetadata, r.Descriptor().EncodeJSON()); err != nil {
		t.Fatal(err)
	}
	raw, err := io.ReadAll(c)
	if err != nil {
		t.Fatal(err)
	}
	if n := binary.LittleEndian.Uint64(raw); n != uint64(len(raw)-8) || raw[8] != HSMetadata || raw[len(raw)-1] != '\n' {
		t.Fatalf("metadata reply framing: length %d of %d bytes, type %d", n, len(raw)-8, raw[8])
	}
	d, err := DecodeDescriptor(raw[9:])
	if err != nil {
		t.Fatal(err)
	}
	want := r.Descriptor()
	if d.Name != r.SessionID() || d.TCPDataPort != want.TCPDataPort || d.TCPProtoVersion != 2 || len(d.Buffers) != 1 || d.Buffers[0] != want.Buffers[0] {
		t.Fatalf("descriptor %+v, want %+v", d, want)
	}
	if !strings.Contains(string(raw[9:]), `"timestamp":"`) {
		t.Fatal("no timestamp")
	}
}

func TestHandshakeLegacyFrame(t *testing.T) {
	// A frame without a type byte is a Connection request answered without one.
	r := startReceiver(t, ReceiverConfig{Buffers: []int{4096}}, nil)
	ev := hsEvents(r)
	c := rawDial(t, r.SessionID())
	if _, err := c.Write(unhex(t, `07 00 00 00 00 00 00 00  7b 22 61 22 3a 31 7d`)); err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(c)
	if err != nil {
		t.Fatal(err)
	}
	want := string(replyConnection)
	if n := binary.LittleEndian.Uint64(got); n != uint64(len(want)) || string(got[8:]) != want {
		t.Fatalf("legacy reply %q", got)
	}
	_ = c.Close()
	if e := <-ev; !e.Legacy || e.Type != HSConnection || e.Err != nil {
		t.Fatalf("event %+v", e)
	}
}

func TestHandshakeFrameSizeLimit(t *testing.T) {
	r := startReceiver(t, ReceiverConfig{Buffers: []int{4096}}, nil)
	ev := hsEvents(r)

	// 1 MiB + 1 announced, 1 byte sent: refused at once, body not awaited.
	c := rawDial(t, r.SessionID())
	if _, err := c.Write(unhex(t, `01 00 10 00 00 00 00 00  01`)); err != nil {
		t.Fatal(err)
	}
	if got, _ := io.ReadAll(c); len(got) != 0 {
		t.Fatalf("reply to an oversized frame: %q", got)
	}
	if e := <-ev; !errors.Is(e.Err, ErrFrameTooLarge) {
		t.Fatalf("event %+v, want ErrFrameTooLarge", e)
	}

	// Length 0: closed without a reply.
	c = rawDial(t, r.SessionID())
	if _, err := c.Write(make([]byte, 8)); err != nil {
		t.Fatal(err)
	}
	if got, _ := io.ReadAll(c); len(got) != 0 {
		t.Fatalf("reply to a zero-length frame: %q", got)
	}
	if e := <-ev; !errors.Is(e.Err, errEmptyFrame) {
		t.Fatalf("event %+v", e)
	}

	// Exactly 1 MiB is accepted.
	c = rawDial(t, r.SessionID())
	body := append(bytes.Repeat([]byte{' '}, MaxHandshakeFrame-3), '{', '}')
	if err := WriteFrame(c, HSProbe, body); err != nil {
		t.Fatal(err)
	}
	if typ, reply, err := ReadFrame(c, 0); err != nil || typ != HSProbe || string(reply) != string(replyProbe) {
		t.Fatalf("reply to a 1 MiB frame: %d %q %v", typ, reply, err)
	}
	_ = c.Close()
	if e := <-ev; e.Err != nil || e.Type != HSProbe {
		t.Fatalf("event %+v", e)
	}
}

func TestHandshakeClosedPromptly(t *testing.T) {
	// The initiator closes as soon as it has the reply: the receiver's wait
	// for the client's close ends in EOF, not in its read timeout.
	r := startReceiver(t, ReceiverConfig{Buffers: []int{4096}}, nil)
	ev := hsEvents(r)
	ini := newInitiator(t, InitiatorConfig{})
	if _, err := ini.Descriptor(testCtx(t), r.SessionID()); err != nil {
		t.Fatal(err)
	}
	if e := <-ev; e.Err != nil || e.Type != HSMetadata || !e.ClientClosed {
		t.Fatalf("event %+v: the initiator did not close the handshake connection", e)
	}
	// Cached: no second handshake.
	if _, err := ini.Descriptor(testCtx(t), r.SessionID()); err != nil {
		t.Fatal(err)
	}
	select {
	case e := <-ev:
		t.Fatalf("second handshake %+v", e)
	default:
	}
}

func TestHandshakeClientThatLingers(t *testing.T) {
	// The contrast to the test above: a client that keeps the connection open
	// is seen as such once the (shortened) read timeout passes.
	r := startReceiver(t, ReceiverConfig{Buffers: []int{4096}}, func(r *Receiver) { r.hsTimeout = 100 * time.Millisecond })
	ev := hsEvents(r)
	c := rawDial(t, r.SessionID())
	if err := WriteFrame(c, HSProbe, []byte("{}")); err != nil {
		t.Fatal(err)
	}
	if _, _, err := ReadFrame(c, 0); err != nil {
		t.Fatal(err)
	}
	e := <-ev // c is still open here
	if e.Err != nil || e.ClientClosed {
		t.Fatalf("event %+v: want a client that did not close", e)
	}
}

func TestHandshakeWrongReplyType(t *testing.T) {
	for _, tt := range []struct {
		name  string
		typ   uint8
		body  string
		errIs string
	}{
		{"probe reply to metadata", HSProbe, `{"status":"success"}`, ErrNotHandshakePeer.Error() + ": a reply of type 3"},
		{"legacy reply", HSConnection, `{"a":1}`, ErrNotHandshakePeer.Error()},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var sid string
			if tt.name == "legacy reply" {
				sid = fakeLegacyHandshake(t, []byte(tt.body))
			} else {
				sid = fakeHandshake(t, func(int, uint8) (uint8, []byte) { return tt.typ, []byte(tt.body) })
			}
			ini := newInitiator(t, InitiatorConfig{})
			_, err := ini.Descriptor(testCtx(t), sid)
			if !errors.Is(err, ErrNotHandshakePeer) || !strings.Contains(err.Error(), tt.errIs) {
				t.Fatalf("err = %v, want ErrNotHandshakePeer and %q", err, tt.errIs)
			}
		})
	}
}

// fakeLegacyHandshake answers one request with a frame without a type byte.
func fakeLegacyHandshake(t *testing.T, body []byte) string {
	return fakeHandshakeRaw(t, func(_ int, _ uint8, w io.Writer) { _ = writeLegacyFrame(w, body) })
}

func TestReceiverRawWriteAndRead(t *testing.T) {
	r := startReceiver(t, ReceiverConfig{Buffers: []int{4096}}, nil)
	b := r.Buffers()[0]
	c := rawDial(t, dataAddrOf(r))

	// v2 write with garbage padding, then a v2 read and a v1 read of it, on one connection.
	hdr := AppendHeader(nil, Header{Size: 5, Addr: b.Addr + 10, Opcode: 0x81})
	copy(hdr[17:], []byte{1, 2, 3, 4, 5, 6, 7})
	if _, err := c.Write(append(hdr, "hello"...)); err != nil {
		t.Fatal(err)
	}
	st := make([]byte, 8)
	if _, err := io.ReadFull(c, st); err != nil || !bytes.Equal(st, unhex(t, `00 00 00 00 56 54 43 4d`)) {
		t.Fatalf("status % x, %v", st, err)
	}
	if _, err := c.Write(AppendHeader(nil, Header{Size: 5, Addr: b.Addr + 10, Opcode: 0x80})); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 13)
	if _, err := io.ReadFull(c, got); err != nil || string(got[8:]) != "hello" || !bytes.Equal(got[:8], st) {
		t.Fatalf("v2 read % x, %v", got, err)
	}
	if _, err := c.Write(AppendHeader(nil, Header{Size: 5, Addr: b.Addr + 10, Opcode: 0x00})); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, got[:5]); err != nil || string(got[:5]) != "hello" {
		t.Fatalf("v1 read %q, %v", got[:5], err)
	}
	// 0x82 is served as a read (anything but WRITE after masking 0x80).
	if _, err := c.Write(AppendHeader(nil, Header{Size: 5, Addr: b.Addr + 10, Opcode: 0x82})); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, got); err != nil || string(got[8:]) != "hello" {
		t.Fatalf("0x82 read % x, %v", got, err)
	}

	// An out-of-range v2 write: ADDR_REJECTED, then the connection closes.
	if _, err := c.Write(AppendHeader(nil, Header{Size: 8, Addr: b.Addr + b.Length - 4, Opcode: 0x81})); err != nil {
		t.Fatal(err)
	}
	rest, _ := io.ReadAll(c)
	if !bytes.Equal(rest, unhex(t, `01 00 00 00 56 54 43 4d`)) {
		t.Fatalf("rejection % x", rest)
	}
	if s := r.Stats(); s.Writes != 1 || s.Reads != 3 || s.Rejected != 1 || s.Bytes != 5 {
		t.Fatalf("stats %+v", s)
	}
}

func TestReceiverRejectsRanges(t *testing.T) {
	r := startReceiver(t, ReceiverConfig{Buffers: []int{4096}}, nil)
	b := r.Buffers()[0]
	for _, h := range []Header{
		{Size: 0, Addr: b.Addr, Opcode: 0x81},            // size 0
		{Size: 16, Addr: 1<<64 - 8, Opcode: 0x81},        // overflow
		{Size: 1, Addr: b.Addr + b.Length, Opcode: 0x80}, // read past the end
		{Size: 4, Addr: b.Addr - 2, Opcode: 0x81},        // before the start
	} {
		c := rawDial(t, dataAddrOf(r))
		if _, err := c.Write(AppendHeader(nil, h)); err != nil {
			t.Fatal(err)
		}
		if rest, _ := io.ReadAll(c); !bytes.Equal(rest, AppendStatus(nil, StatusAddrRejected)) {
			t.Fatalf("%+v: % x", h, rest)
		}
	}
	// A v1 request out of range only sees the close.
	c := rawDial(t, dataAddrOf(r))
	if _, err := c.Write(AppendHeader(nil, Header{Size: 4, Addr: 8, Opcode: 0x01})); err != nil {
		t.Fatal(err)
	}
	if rest, _ := io.ReadAll(c); len(rest) != 0 {
		t.Fatalf("v1 rejection sent % x", rest)
	}
	if s := r.Stats(); s.Rejected != 5 || s.Writes != 0 {
		t.Fatalf("stats %+v", s)
	}
}

func TestReceiverV1TreatsFlaggedWriteAsRead(t *testing.T) {
	// The "stale descriptor" failure mode (§1.3): a v1 server does not mask
	// 0x80, so 0x81 reads back instead of writing, with no status frame.
	r := startReceiver(t, ReceiverConfig{Buffers: []int{64}, ProtoVersion: 1}, nil)
	b := r.Buffers()[0]
	c := rawDial(t, dataAddrOf(r))
	if _, err := c.Write(AppendHeader(nil, Header{Size: 4, Addr: b.Addr, Opcode: 0x81})); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 4)
	if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, make([]byte, 4)) {
		t.Fatalf("% x, %v", got, err)
	}
	if s := r.Stats(); s.Reads != 1 || s.Writes != 0 {
		t.Fatalf("stats %+v", s)
	}
}

func TestNewReceiverValidation(t *testing.T) {
	for _, cfg := range []ReceiverConfig{
		{},                                   // no buffers
		{Buffers: []int{0}},                  // empty buffer
		{Buffers: []int{8}, ProtoVersion: 3}, // unknown version
		{Buffers: []int{8}, HandshakeListen: "0.0.0.0:0"}, // wildcard without advertise_host
	} {
		if _, err := NewReceiver(cfg, nil); err == nil {
			t.Errorf("NewReceiver(%+v) accepted", cfg)
		}
	}
	r, err := NewReceiver(ReceiverConfig{Buffers: []int{8}, HandshakeListen: "0.0.0.0:0", AdvertiseHost: "127.0.0.1"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Start(); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(r.SessionID(), "127.0.0.1:") {
		t.Fatalf("session id %q", r.SessionID())
	}
	if err := r.Start(); err == nil {
		t.Fatal("second Start accepted")
	}
	if _, err := r.Bytes(r.Buffers()[0].Addr, 9); err == nil {
		t.Fatal("Bytes past the buffer accepted")
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
}

func TestReceiverCloseEndsOpenSessions(t *testing.T) {
	r, err := NewReceiver(ReceiverConfig{Buffers: []int{64}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Start(); err != nil {
		t.Fatal(err)
	}
	// An idle pooled data connection and a handshake connection that sent nothing.
	ini := NewInitiator(InitiatorConfig{})
	defer ini.Close()
	if _, err := ini.Write(testCtx(t), r.SessionID(), r.Buffers()[0].Addr, []byte("x")); err != nil {
		t.Fatal(err)
	}
	rawDial(t, r.SessionID())
	if err := r.Close(); err != nil { // returns only once every goroutine is done (goleak checks the rest)
		t.Fatal(err)
	}
}
