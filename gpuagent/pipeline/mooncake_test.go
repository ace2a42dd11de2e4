package pipeline

import (
	"bytes"
	"context"
	"errors"
	"io"
	"testing"

	"go.uber.org/zap"

	"github.com/encgate/encgate/gpuagent/mooncake"
)

func receiver(t testing.TB, n, version int) *mooncake.Receiver {
	t.Helper()
	r, err := mooncake.NewReceiver(mooncake.ReceiverConfig{
		HandshakeListen: "127.0.0.1:0", DataListen: "127.0.0.1:0", AdvertiseHost: "127.0.0.1",
		Buffers: []int{n}, ProtoVersion: version,
	}, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	return r
}

// A pipelined payload lands whole in a real Mooncake receiver, v1 and v2;
// a source that fails mid-body ends the write with a *PayloadError at once
// (not retried: the pass is opened once), and the receiver takes the next
// transfer.
func TestPipelineIntoAMooncakeReceiver(t *testing.T) {
	const size = 3<<20 + 123
	for _, version := range []int{1, 2} {
		r := receiver(t, size, version)
		addr := r.Buffers()[0].Addr
		ini := mooncake.NewInitiator(mooncake.InitiatorConfig{})
		defer ini.Close()
		ctx := context.Background()

		src := newAsync(size)
		res, err := ini.WriteFrom(ctx, r.SessionID(), addr, Transfer{src, Config{ChunkBytes: 256 << 10, Depth: 3}})
		if err != nil || res.Bytes != size {
			t.Fatalf("v%d: WriteFrom = %+v, %v", version, res, err)
		}
		got, err := r.Bytes(addr, size)
		if err != nil || !bytes.Equal(got, src.data) {
			t.Fatalf("v%d: the receiver's buffer differs from the source (%v)", version, err)
		}
		src.check(t)

		bad := newAsync(size)
		bad.failWait = 5
		_, err = ini.WriteFrom(ctx, r.SessionID(), addr, Transfer{bad, Config{ChunkBytes: 256 << 10, Depth: 3}})
		var pe *mooncake.PayloadError
		if !errors.As(err, &pe) || !bytes.Contains([]byte(err.Error()), []byte("injected copy failure at chunk 5")) {
			t.Fatalf("v%d: a failing source gave %v, want a *mooncake.PayloadError naming the copy failure", version, err)
		}
		if bad.opens != 1 {
			t.Fatalf("v%d: a payload failure was retried (%d passes)", version, bad.opens)
		}
		bad.check(t)

		again := newAsync(size)
		again.data[0] ^= 0xff
		if _, err := ini.WriteFrom(ctx, r.SessionID(), addr, Transfer{again, Config{ChunkBytes: 1 << 20, Depth: 2}}); err != nil {
			t.Fatalf("v%d: the transfer after a failed one: %v", version, err)
		}
		if got, _ := r.Bytes(addr, size); !bytes.Equal(got, again.data) {
			t.Fatalf("v%d: the transfer after a failed one did not land", version)
		}
	}
}

// A payload that sends fewer bytes than its Len, or more, is a
// *PayloadError: the peer would wait for the rest, or read the excess as
// the next header.
func TestPayloadThatMisstatesItsLength(t *testing.T) {
	r := receiver(t, 1<<20, 2)
	addr := r.Buffers()[0].Addr
	ini := mooncake.NewInitiator(mooncake.InitiatorConfig{})
	defer ini.Close()
	var pe *mooncake.PayloadError
	_, err := ini.WriteFrom(context.Background(), r.SessionID(), addr, lying{n: 1000, send: 990})
	if !errors.As(err, &pe) || !bytes.Contains([]byte(err.Error()), []byte("it sent 990 of its 1000 bytes")) {
		t.Fatalf("short payload: %v", err)
	}
	_, err = ini.WriteFrom(context.Background(), r.SessionID(), addr, lying{n: 1000, send: 1001})
	if err == nil || !bytes.Contains([]byte(err.Error()), []byte("past the payload's end")) {
		t.Fatalf("long payload: %v", err)
	}
	if _, err := ini.WriteFrom(context.Background(), r.SessionID(), addr, lying{n: 1000, send: 1000}); err != nil {
		t.Fatalf("an honest payload after: %v", err)
	}
}

type lying struct{ n, send int }

func (l lying) Len() int64 { return int64(l.n) }

func (l lying) Send(_ context.Context, w io.Writer) error {
	_, err := w.Write(make([]byte, l.send))
	return err
}
