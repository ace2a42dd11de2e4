package mooncake

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"
)

// v1Peer is a minimal receiver written independently of Receiver, behaving as
// Mooncake <= v0.3.9 does: its handshake answers a descriptor without
// tcp_proto_version, and its data port reads one header and its body and then
// closes, with no status frame and no validation beyond what it needs not to
// crash. Its "memory" is a local array at a made-up base address.
type v1Peer struct {
	hsLn, dataLn net.Listener
	wg           sync.WaitGroup
	requests     chan v1Request
}

type v1Request struct {
	header [24]byte
	mem    []byte // a snapshot of the memory after the request
}

const (
	v1Base = 0x7f00_dead_0000
	v1Size = 4096
)

func startV1Peer(t *testing.T) *v1Peer {
	t.Helper()
	p := &v1Peer{requests: make(chan v1Request, 8)}
	var err error
	if p.hsLn, err = net.Listen("tcp4", "127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	if p.dataLn, err = net.Listen("tcp4", "127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	name := p.hsLn.Addr().String()
	desc := fmt.Sprintf(`{"buffers":[{"addr":%d,"length":%d,"name":%q}],"name":%q,"protocol":"tcp","tcp_data_port":%d,"timestamp":"2025-06-01 10:00:00.000000"}`+"\n",
		v1Base, v1Size, name, name, p.dataLn.Addr().(*net.TCPAddr).Port)
	mem := bytes.Repeat([]byte{0xAA}, v1Size)

	p.wg.Add(2)
	go func() { // handshake: one connection at a time
		defer p.wg.Done()
		for {
			c, err := p.hsLn.Accept()
			if err != nil {
				return
			}
			_ = c.SetDeadline(time.Now().Add(5 * time.Second))
			var lb [8]byte
			if _, err := io.ReadFull(c, lb[:]); err == nil {
				n := binary.LittleEndian.Uint64(lb[:])
				req := make([]byte, n)
				if n > 0 && n <= 1<<20 {
					if _, err := io.ReadFull(c, req); err == nil {
						out := binary.LittleEndian.AppendUint64(nil, uint64(len(desc))+1)
						out = append(out, req[0]) // same type
						out = append(out, desc...)
						_, _ = c.Write(out)
						_ = c.(*net.TCPConn).CloseWrite()
						_, _ = io.Copy(io.Discard, c)
					}
				}
			}
			_ = c.Close()
		}
	}()
	go func() { // data: one request per connection, then close
		defer p.wg.Done()
		for {
			c, err := p.dataLn.Accept()
			if err != nil {
				return
			}
			var r v1Request
			if _, err := io.ReadFull(c, r.header[:]); err == nil {
				size := binary.LittleEndian.Uint64(r.header[0:8])
				addr := binary.LittleEndian.Uint64(r.header[8:16])
				if r.header[16] == 1 && addr >= v1Base && addr+size <= v1Base+v1Size {
					_, _ = io.ReadFull(c, mem[addr-v1Base:addr-v1Base+size])
				}
			}
			r.mem = append([]byte(nil), mem...)
			p.requests <- r // recorded before the close the initiator waits for
			_ = c.Close()   // v0.3.9: the session ends after one request
		}
	}()
	t.Cleanup(func() {
		_ = p.hsLn.Close()
		_ = p.dataLn.Close()
		p.wg.Wait()
	})
	return p
}

func TestWriteToV1OnlyPeer(t *testing.T) {
	p := startV1Peer(t)
	ini := newInitiator(t, InitiatorConfig{})
	ctx := testCtx(t)
	sid := p.hsLn.Addr().String()

	d, err := ini.Descriptor(ctx, sid)
	if err != nil {
		t.Fatal(err)
	}
	if d.TCPProtoVersion != 1 {
		t.Fatalf("descriptor without tcp_proto_version decoded as v%d", d.TCPProtoVersion)
	}

	payload := pattern(300, 0x42)
	const off = 100
	for round := range 2 {
		res, err := ini.Write(ctx, sid, v1Base+off, payload)
		if err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		if res != (Result{Bytes: 300, Version: 1}) {
			t.Fatalf("round %d: %+v", round, res)
		}
		// EOF confirmed the write, so the peer has already recorded it.
		var req v1Request
		select {
		case req = <-p.requests:
		default:
			t.Fatalf("round %d: Write returned before the peer applied the bytes", round)
		}
		wantHdr := unhex(t, `2c 01 00 00 00 00 00 00  64 00 ad de 00 7f 00 00  01  00 00 00 00 00 00 00`)
		if !bytes.Equal(req.header[:], wantHdr) {
			t.Fatalf("header % x\nwant   % x", req.header, wantHdr)
		}
		if !bytes.Equal(req.mem[off:off+300], payload) {
			t.Fatal("payload not at the offset")
		}
		for i, c := range req.mem {
			if (i < off || i >= off+300) && c != 0xAA {
				t.Fatalf("byte %d outside the range changed", i)
			}
		}
	}

	// Out of range: refused before the peer sees a connection.
	var re *RangeError
	if _, err := ini.Write(ctx, sid, v1Base+v1Size-1, []byte("ab")); !errors.As(err, &re) {
		t.Fatalf("err = %v", err)
	}
	select {
	case req := <-p.requests:
		t.Fatalf("the peer got a request: % x", req.header)
	default:
	}
}
