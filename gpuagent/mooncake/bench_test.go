package mooncake

import (
	"context"
	"testing"

	"go.uber.org/zap"
)

// BenchmarkWrite measures Initiator.Write into this package's Receiver over
// loopback: v2 on a pooled connection, and v1 (a connection per write).
func BenchmarkWrite(b *testing.B) {
	for _, bc := range []struct {
		name    string
		version int
		size    int
	}{
		{"v2/64KiB", 2, 64 << 10},
		{"v2/4MiB", 2, 4 << 20},
		{"v1/4MiB", 1, 4 << 20},
	} {
		b.Run(bc.name, func(b *testing.B) {
			r, err := NewReceiver(ReceiverConfig{Buffers: []int{bc.size}, ProtoVersion: bc.version}, zap.NewNop())
			if err != nil {
				b.Fatal(err)
			}
			if err := r.Start(); err != nil {
				b.Fatal(err)
			}
			defer r.Close()
			ini := NewInitiator(InitiatorConfig{})
			defer ini.Close()
			payload := pattern(bc.size, 1)
			addr := r.Buffers()[0].Addr
			ctx := context.Background()
			b.SetBytes(int64(bc.size))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := ini.Write(ctx, r.SessionID(), addr, payload); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
