package pipeline

import (
	"context"
	"fmt"
	"testing"

	"github.com/encgate/encgate/gpuagent/mooncake"
)

// BenchmarkHostTransfer moves a host-memory embedding into a Mooncake v2
// receiver over loopback two ways, side by side: "writev" is the path
// before the pipeline (Initiator.Write: header and bytes in one writev),
// "pipeline" is the host Source through Send at each chunk size, depth 3
// (what the agent now does for host stages). bench/pipeline.sh runs them
// in alternating rounds and prints the ratios.
func BenchmarkHostTransfer(b *testing.B) {
	for _, size := range []int{8 << 20, 64 << 20} {
		r := receiver(b, size, 2)
		addr := r.Buffers()[0].Addr
		data := pattern(size)
		ini := mooncake.NewInitiator(mooncake.InitiatorConfig{})
		b.Cleanup(func() { _ = ini.Close() })
		ctx := context.Background()
		name := fmt.Sprintf("%dMiB", size>>20)
		b.Run(name+"/writev", func(b *testing.B) {
			b.SetBytes(int64(size))
			for b.Loop() {
				if _, err := ini.Write(ctx, r.SessionID(), addr, data); err != nil {
					b.Fatal(err)
				}
			}
		})
		for _, chunk := range []int{256 << 10, 1 << 20, 4 << 20} {
			tr := Transfer{Source: Host(data), Config: Config{ChunkBytes: chunk, Depth: 3}}
			b.Run(fmt.Sprintf("%s/pipeline-%dKiB", name, chunk>>10), func(b *testing.B) {
				b.SetBytes(int64(size))
				b.ReportAllocs()
				for b.Loop() {
					if _, err := ini.WriteFrom(ctx, r.SessionID(), addr, tr); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
