package mooncake

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// bannerServer listens on loopback and answers every connection with reply as
// soon as it connects, then reads until the client closes. It returns its
// address.
func bannerServer(t *testing.T, reply []byte) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Go(func() {
				defer c.Close()
				_ = c.SetDeadline(time.Now().Add(10 * time.Second))
				_, _ = c.Write(reply)
				_, _ = io.Copy(io.Discard, c)
			})
		}
	})
	t.Cleanup(func() {
		_ = ln.Close()
		wg.Wait()
	})
	return ln.Addr().String()
}

// renderings are the ways the first 8 bytes of b could show up as a number
// (those of 6 characters or more: "0" is in every address).
func renderings(b []byte) []string {
	var out []string
	for _, u := range []uint64{binary.LittleEndian.Uint64(b), binary.BigEndian.Uint64(b)} {
		for _, s := range []string{strconv.FormatUint(u, 10), strconv.FormatInt(int64(u), 10),
			strconv.FormatUint(u, 16), fmt.Sprintf("%#x", u)} {
			if len(s) >= 6 {
				out = append(out, s)
			}
		}
	}
	return out
}

func assertNoPeerBytes(t *testing.T, msg string, forbidden []string) {
	t.Helper()
	for _, f := range forbidden {
		if strings.Contains(msg, f) {
			t.Fatalf("error %q quotes the peer (%q)", msg, f)
		}
	}
}

// A /send aimed at a service that is not Mooncake (a web server, an SSH
// server) fails with ErrNotHandshakePeer, and its text quotes nothing the
// service sent: not its bytes, and no number read from them.
func TestHandshakeNotAPeerQuotesNothing(t *testing.T) {
	httpBanner := []byte("HTTP/1.1 200 OK\r\nServer: secret-banner/9.9\r\n\r\n")
	ssh := []byte("SSH-2.0-OpenSSH_9.6 secret")
	frame := func(typ int, body []byte) []byte {
		var b bytes.Buffer
		if typ < 0 {
			_ = writeLegacyFrame(&b, body)
		} else {
			_ = WriteFrame(&b, uint8(typ), body)
		}
		return b.Bytes()
	}
	for _, tt := range []struct {
		name  string
		reply []byte
		is    error // also matched, besides ErrNotHandshakePeer
	}{
		{"http server", httpBanner, ErrFrameTooLarge},
		{"ssh text in an untyped frame of a valid length", frame(-1, ssh), nil},
		{"ssh text in a metadata frame", frame(int(HSMetadata), ssh), nil},
		{"json but not an object", frame(int(HSMetadata), []byte(`"SSH secret banner"`)), nil},
		{"zero length then text", append(make([]byte, 8), ssh...), nil},
	} {
		t.Run(tt.name, func(t *testing.T) {
			sid := bannerServer(t, tt.reply)
			ini := newInitiator(t, InitiatorConfig{})
			_, err := ini.Write(testCtx(t), sid, 4096, []byte("x"))
			if !errors.Is(err, ErrNotHandshakePeer) {
				t.Fatalf("err = %v, want ErrNotHandshakePeer", err)
			}
			if tt.is != nil && !errors.Is(err, tt.is) {
				t.Fatalf("err = %v, want it to match %v too", err, tt.is)
			}
			want := "mooncake: handshake with " + sid + ": not a Mooncake handshake peer (reply not in the expected form)"
			if err.Error() != want {
				t.Fatalf("err = %q, want %q", err, want)
			}
			forbidden := append([]string{"HTTP", "secret", "banner", "SSH", "OpenSSH", "3543824036068086856"}, renderings(tt.reply[:8])...)
			assertNoPeerBytes(t, err.Error(), forbidden)
			if _, err := ini.Descriptor(testCtx(t), sid); !errors.Is(err, ErrNotHandshakePeer) {
				t.Fatalf("Descriptor: %v", err)
			}
		})
	}
}

// A Metadata reply that is a JSON object but fails a field check names the
// field, never its value.
func TestHandshakeBadDescriptorQuotesNoValue(t *testing.T) {
	for _, tt := range []struct{ name, body, reason string }{
		{"port", `{"name":"secret:1","protocol":"tcp","tcp_data_port":99999999}`, "tcp_data_port is above 65535"},
		{"buffer", `{"name":"secret:1","protocol":"tcp","tcp_data_port":1,"buffers":[{"name":"","addr":77777777,"length":0}]}`, "corrupted segment descriptor"},
		{"addr", `{"name":"secret:1","protocol":"tcp","buffers":[{"name":"secret","addr":-77777777,"length":1}]}`, "addr is not an integer"},
		{"protocol", `{"name":"secret:1","protocol":{"secret":"banner"}}`, "protocol is neither"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			sid := fakeHandshake(t, func(int, uint8) (uint8, []byte) { return HSMetadata, []byte(tt.body) })
			ini := newInitiator(t, InitiatorConfig{})
			_, err := ini.Write(testCtx(t), sid, 4096, []byte("x"))
			if !errors.Is(err, ErrNotHandshakePeer) || !strings.Contains(err.Error(), ErrNotHandshakePeer.Error()+": ") ||
				!strings.Contains(err.Error(), tt.reason) {
				t.Fatalf("err = %v, want ErrNotHandshakePeer and %q", err, tt.reason)
			}
			assertNoPeerBytes(t, err.Error(), []string{"secret", "banner", "99999999", "77777777"})
		})
	}
}

// A receiver whose descriptor does not list tcp: its protocol names are not
// quoted.
func TestNotTCPQuotesNoProtocol(t *testing.T) {
	body := []byte(`{"name":"127.0.0.1:1","protocol":"secret-banner","buffers":[{"name":"x","addr":4096,"length":4096}]}`)
	sid := fakeHandshake(t, func(int, uint8) (uint8, []byte) { return HSMetadata, body })
	ini := newInitiator(t, InitiatorConfig{})
	_, err := ini.Write(testCtx(t), sid, 4096, []byte("x"))
	if !errors.Is(err, ErrNotTCP) {
		t.Fatalf("err = %v, want ErrNotTCP", err)
	}
	assertNoPeerBytes(t, err.Error(), []string{"secret", "banner"})
}

// A data port that answers with something other than a status frame: the
// error says what check failed, not the bytes or the status value.
func TestStatusFrameQuotesNothing(t *testing.T) {
	for _, tt := range []struct {
		name  string
		reply []byte
		is    error
		has   string
	}{
		{"bad magic", []byte("SSH-2.0-OpenSSH_9.6 secret\r\n"), ErrBadMagic, "wrong magic"},
		{"unknown status", AppendStatus(nil, 0xdeadbeef), nil, "unknown status"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			data := bannerServer(t, tt.reply)
			_, port, _ := net.SplitHostPort(data)
			p, _ := strconv.Atoi(port)
			desc := Descriptor{Name: "127.0.0.1:1", Protocols: []string{"tcp"}, TCPDataPort: p, TCPProtoVersion: 2,
				Buffers: []Buffer{{Name: "127.0.0.1:1", Addr: 4096, Length: 4096}}}
			sid := fakeHandshake(t, func(int, uint8) (uint8, []byte) { return HSMetadata, desc.EncodeJSON() })
			ini := newInitiator(t, InitiatorConfig{})
			_, err := ini.Write(testCtx(t), sid, 4096, []byte("x"))
			if err == nil || (tt.is != nil && !errors.Is(err, tt.is)) || !strings.Contains(err.Error(), tt.has) {
				t.Fatalf("err = %v, want %q", err, tt.has)
			}
			forbidden := append([]string{"SSH", "secret", "deadbeef", strconv.FormatUint(0xdeadbeef, 10)}, renderings(tt.reply[:8])...)
			assertNoPeerBytes(t, err.Error(), forbidden)
		})
	}
}

// ReadFrame's ErrFrameTooLarge does not print the length it refused.
func TestFrameTooLargeQuotesNoLength(t *testing.T) {
	in := []byte("HTTP/1.1 200 OK\r\n\r\n")
	_, _, err := ReadFrame(bytes.NewReader(in), 0)
	if !errors.Is(err, ErrFrameTooLarge) {
		t.Fatalf("err = %v, want ErrFrameTooLarge", err)
	}
	assertNoPeerBytes(t, err.Error(), append([]string{"HTTP"}, renderings(in)...))
}
