package mooncake

import (
	"context"
	"errors"
	"net"
	"strings"
	"testing"
	"time"
)

// failingConn fails every Write, as a payload read from a shared-memory
// file that was truncated under the sender does.
type failingConn struct{ net.Conn }

func (failingConn) Write([]byte) (int, error) { return 0, errors.New("injected write failure") }

// A body that cannot be sent ends the transfer with that error at once,
// not with a status-frame timeout: the peer here never answers.
func TestWriteV2ReturnsTheSendErrorWithoutWaitingForAStatusFrame(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err == nil {
			accepted <- c
		}
	}()
	conn, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	peer := <-accepted
	defer peer.Close()
	// A generous deadline: without the fix the reader would end with it.
	_ = conn.SetDeadline(time.Now().Add(30 * time.Second))
	err = writeV2(context.Background(), failingConn{conn}, AppendHeader(nil, Header{Size: 4, Addr: 1, Opcode: OpWrite | FlagV2}), bytesPayload("data"))
	if err == nil || !strings.Contains(err.Error(), "injected write failure") {
		t.Fatalf("writeV2 = %v, want the send error", err)
	}
}
