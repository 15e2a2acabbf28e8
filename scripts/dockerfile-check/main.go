// dockerfile-check: buildkit's own Dockerfile checks (what `docker build --check` runs), with
// no Docker engine and no registry: each file's parse errors and lint warnings, one line each.
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/moby/buildkit/client/llb"
	"github.com/moby/buildkit/client/llb/sourceresolver"
	"github.com/moby/buildkit/frontend/dockerfile/dockerfile2llb"
	digest "github.com/opencontainers/go-digest"
)

// offline answers every base image with an empty Linux image: no registry is reachable, and
// no check needs more than that (variables a base image defines read as undefined).
type offline struct{}

func (offline) ResolveImageConfig(_ context.Context, ref string, _ sourceresolver.Opt) (string, digest.Digest, []byte, error) {
	config := []byte(`{"architecture":"amd64","os":"linux","config":{}}`)
	return ref, digest.FromBytes(config), config, nil
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: dockerfile-check DOCKERFILE...")
		os.Exit(2)
	}
	bad := 0
	for _, path := range os.Args[1:] {
		src, err := os.ReadFile(path)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		source := llb.NewSourceMap(nil, path, "Dockerfile", src)
		source.Definition = &llb.Definition{} // no build graph: only the checks run
		opt := dockerfile2llb.ConvertOpt{SourceMap: source, MetaResolver: offline{}}
		results, err := dockerfile2llb.DockerfileLint(context.Background(), src, opt)
		if err != nil {
			fmt.Printf("%s: %v\n", path, err)
			bad++
			continue
		}
		for _, w := range results.Warnings {
			line := 0
			if len(w.Location.Ranges) > 0 {
				line = int(w.Location.Ranges[0].Start.Line)
			}
			fmt.Printf("%s:%d: %s: %s\n", path, line, w.RuleName, w.Detail)
			bad++
		}
		if results.Error != nil {
			fmt.Printf("%s: %s\n", path, results.Error.Message)
			bad++
		}
	}
	if bad > 0 {
		os.Exit(1)
	}
}
