// Command image builds the encgate container image without a container
// engine: it compiles a static encgate binary (CGO off) and assembles an
// image from scratch with github.com/google/go-containerregistry, then
// writes it as a tarball that `docker load` and `podman load` accept: a
// docker-archive (the default) or, with --format oci, an OCI image layout.
//
//	go run ./deploy/image --out encgate.tar [--format docker|oci] [--arch amd64] [--version v1.2.3] [--tag REF]
//	docker load -i encgate.tar        # or: podman load -i encgate.tar
//	docker run --rm --ulimit nofile=16384:16384 -p 8080:8080 -p 9090:9090 ghcr.io/encgate/encgate:dev
//
// Nothing is downloaded: there is no base image. The image holds /encgate
// (entrypoint ["/encgate"], user 65532:65532), the gateway config
// configs/gateway-containers.yaml at /etc/encgate/gateway.yaml (validated
// here; Cmd ["gateway", "--config", "/etc/encgate/gateway.yaml"], its
// listeners' ports exposed) and an empty /tmp. The build is reproducible:
// the same sources, toolchain, flags and SOURCE_DATE_EPOCH give the same
// image digest.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"syscall"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// defaultRepo is the repository the Kubernetes manifests name; with no
// --tag and no --version the image is tagged defaultRepo:dev.
const defaultRepo = "ghcr.io/encgate/encgate"

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// run is the whole program; it returns the exit status (0 ok, 1 failure,
// 2 bad usage).
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("image", flag.ContinueOnError)
	fs.SetOutput(stderr)
	out := fs.String("out", "", "image tarball `file` to write (required)")
	format := fs.String("format", formatDocker, "tarball `format`: "+formatDocker+" (docker-archive, for docker load and podman load) or "+formatOCI+" (an OCI image layout: oci-layout, index.json, blobs/sha256/...; podman load, docker load since Docker 25, skopeo oci-archive:)")
	arch := fs.String("arch", runtime.GOARCH, "target `GOARCH` (linux only): "+supportedArchs())
	versionFlag := fs.String("version", "", "encgate `version` baked into the binary and labels (default: `git describe --always --dirty`, else dev)")
	tagFlag := fs.String("tag", "", "image `reference` recorded in the tarball (default "+defaultRepo+":<--version, or dev>)")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: go run ./deploy/image --out FILE [--format docker|oci] [--arch GOARCH] [--version V] [--tag REF]\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "image: unexpected argument %q\n", fs.Arg(0))
		return 2
	}
	if *out == "" {
		fmt.Fprintln(stderr, "image: --out is required")
		return 2
	}
	if *format != formatDocker && *format != formatOCI {
		fmt.Fprintf(stderr, "image: unknown --format %q (%s or %s)\n", *format, formatDocker, formatOCI)
		return 2
	}
	if err := checkArch(*arch); err != nil {
		fmt.Fprintln(stderr, "image:", err)
		return 2
	}

	if *versionFlag != "" {
		if err := checkVersion(*versionFlag); err != nil {
			fmt.Fprintln(stderr, "image:", err)
			return 2
		}
	}

	// The tag follows --version only when it is given: a plain build is
	// always ghcr.io/encgate/encgate:dev, the reference the manifests use.
	tagVersion := "dev"
	if *versionFlag != "" {
		tagVersion = *versionFlag
	}
	tagStr := *tagFlag
	if tagStr == "" {
		tagStr = defaultRepo + ":" + tagVersion
	}
	tag, err := name.NewTag(tagStr, name.StrictValidation)
	if err != nil {
		fmt.Fprintf(stderr, "image: bad tag %q: %v\n", tagStr, err)
		return 2
	}
	created, err := sourceDateEpoch(os.Getenv("SOURCE_DATE_EPOCH"))
	if err != nil {
		fmt.Fprintln(stderr, "image:", err)
		return 2
	}

	root, err := moduleRoot(ctx)
	if err != nil {
		fmt.Fprintln(stderr, "image:", err)
		return 1
	}
	version := *versionFlag
	if version == "" {
		if version = gitDescribe(ctx, root); version == "" {
			version = "dev"
		}
	}
	if err := checkVersion(version); err != nil { // from git describe
		fmt.Fprintln(stderr, "image:", err)
		return 1
	}

	config, ports, err := containerConfig(root)
	if err != nil {
		fmt.Fprintln(stderr, "image:", err)
		return 1
	}

	tmp, err := os.MkdirTemp("", "encgate-image-")
	if err != nil {
		fmt.Fprintln(stderr, "image:", err)
		return 1
	}
	defer os.RemoveAll(tmp)

	bin, err := buildBinary(ctx, root, *arch, version, tmp)
	if err != nil {
		fmt.Fprintln(stderr, "image:", err)
		return 1
	}
	spec := imageSpec{Arch: *arch, Version: version, Revision: gitHead(ctx, root), Created: created,
		Config: config, Ports: ports}
	img, err := buildImage(bin, spec)
	if err != nil {
		fmt.Fprintln(stderr, "image:", err)
		return 1
	}
	digest, err := img.Digest()
	if err != nil {
		fmt.Fprintln(stderr, "image:", err)
		return 1
	}
	id, err := img.ConfigName()
	if err != nil {
		fmt.Fprintln(stderr, "image:", err)
		return 1
	}
	size, err := writeTarball(*out, *format, tag, img, created)
	if err != nil {
		fmt.Fprintln(stderr, "image:", err)
		return 1
	}
	fmt.Fprintf(stdout, "wrote %s (%d bytes)\n", *out, size)
	fmt.Fprintf(stdout, "  format   %s\n", *format)
	fmt.Fprintf(stdout, "  tag      %s\n", tag.String())
	fmt.Fprintf(stdout, "  version  %s (linux/%s)\n", version, *arch)
	fmt.Fprintf(stdout, "  digest   %s\n", digest)
	fmt.Fprintf(stdout, "  image id %s\n", id)
	return 0
}

// writeTarball writes img tagged tag to out in format through a temporary
// file in the same directory, so a failed run never leaves a truncated
// tarball at out. It returns the file's size.
func writeTarball(out, format string, tag name.Tag, img v1.Image, created time.Time) (int64, error) {
	dir := filepath.Dir(out)
	f, err := os.CreateTemp(dir, "."+filepath.Base(out)+".*")
	if err != nil {
		return 0, err
	}
	tmp := f.Name()
	var werr error
	if format == formatOCI {
		werr = ociArchive(f, tag, img, created)
		if cerr := f.Close(); werr == nil {
			werr = cerr
		}
	} else {
		_ = f.Close()
		werr = tarball.WriteToFile(tmp, tag, img)
	}
	if werr != nil {
		_ = os.Remove(tmp)
		return 0, fmt.Errorf("write %s: %w", out, werr)
	}
	// CreateTemp makes the file 0600; an image tarball is not a secret.
	if err := os.Chmod(tmp, 0o644); err != nil {
		_ = os.Remove(tmp)
		return 0, err
	}
	if err := os.Rename(tmp, out); err != nil {
		_ = os.Remove(tmp)
		return 0, err
	}
	st, err := os.Stat(out)
	if err != nil {
		return 0, err
	}
	return st.Size(), nil
}
