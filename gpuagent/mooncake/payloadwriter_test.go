package mooncake

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"slices"
	"testing"
)

// recordingConn keeps what is written to it, and fails once it has taken
// limit bytes (limit < 0: never).
type recordingConn struct {
	net.Conn
	got   bytes.Buffer
	limit int
}

var errConnFull = errors.New("injected: the connection took all it will")

func (c *recordingConn) Write(p []byte) (int, error) {
	if c.limit >= 0 && c.got.Len()+len(p) > c.limit {
		n := c.limit - c.got.Len()
		c.got.Write(p[:n])
		return n, errConnFull
	}
	return c.got.Write(p)
}

// chunkedPayload sends its bytes in writes of size bytes, and records what
// each write returned.
type chunkedPayload struct {
	data []byte
	size int
	ns   []int
}

func (p *chunkedPayload) Len() int64 { return int64(len(p.data)) }

func (p *chunkedPayload) Send(_ context.Context, w io.Writer) error {
	for off := 0; off < len(p.data); off += p.size {
		n, err := w.Write(p.data[off:min(off+p.size, len(p.data))])
		p.ns = append(p.ns, n)
		if err != nil {
			return err
		}
	}
	return nil
}

// The header goes out with the payload's first write, in front of it; each
// write the payload makes counts its own bytes only, so a payload that sends
// exactly Len bytes is complete.
func TestPayloadWriterSendsTheHeaderWithTheFirstWrite(t *testing.T) {
	hdr := AppendHeader(nil, Header{Size: 10, Addr: 0x1000, Opcode: OpWrite | FlagV2})
	p := &chunkedPayload{data: []byte("0123456789"), size: 4}
	c := &recordingConn{limit: -1}
	if err := sendPayload(context.Background(), c, hdr, p); err != nil {
		t.Fatalf("sendPayload = %v", err)
	}
	if want := append(append([]byte(nil), hdr...), p.data...); !bytes.Equal(c.got.Bytes(), want) {
		t.Fatalf("the connection got %q, want the header then the payload %q", c.got.Bytes(), want)
	}
	if want := []int{4, 4, 2}; !slices.Equal(p.ns, want) {
		t.Fatalf("the payload's writes returned %v, want %v", p.ns, want)
	}
}

// A connection that fails inside the header, or inside the first write's
// payload bytes, is the connection's error (not the payload's), and the
// payload is told how many of its own bytes went out.
func TestPayloadWriterCountsOnlyPayloadBytesWhenTheConnectionFails(t *testing.T) {
	hdr := AppendHeader(nil, Header{Size: 10, Addr: 0x1000, Opcode: OpWrite | FlagV2})
	for _, tc := range []struct {
		limit int
		want  []int // what the payload's writes returned
	}{
		{limit: 10, want: []int{0}},                    // inside the header
		{limit: HeaderSize + 3, want: []int{3}},        // inside the first write
		{limit: HeaderSize + 6, want: []int{4, 2}},     // inside the second write
		{limit: HeaderSize + 10, want: []int{4, 4, 2}}, // all of it
	} {
		p := &chunkedPayload{data: []byte("0123456789"), size: 4}
		c := &recordingConn{limit: tc.limit}
		err := sendPayload(context.Background(), c, hdr, p)
		var pe *PayloadError
		switch {
		case tc.limit == HeaderSize+10 && err != nil:
			t.Fatalf("limit %d: sendPayload = %v, want nil", tc.limit, err)
		case tc.limit < HeaderSize+10 && (!errors.Is(err, errConnFull) || errors.As(err, &pe)):
			t.Fatalf("limit %d: sendPayload = %v, want the connection's error", tc.limit, err)
		}
		if !slices.Equal(p.ns, tc.want) {
			t.Fatalf("limit %d: the payload's writes returned %v, want %v", tc.limit, p.ns, tc.want)
		}
	}
}
