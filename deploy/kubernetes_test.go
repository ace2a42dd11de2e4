package deploy

// Checks of the Kubernetes kit in kubernetes/: every manifest decodes
// strictly into the real API types, every encgate container runs a real
// subcommand with real flags on a config from the ConfigMaps that the real
// loaders accept, every probe is served where it points, and the pieces
// (Services, the PodDisruptionBudgets, the Redis sentinels and password,
// the Secrets) name each other correctly. The configs are also run: the
// built binary serves the manifests' probe paths on loopback and dedupes a
// /send through Sentinel, and the kit's Redis script runs a Sentinel set
// on loopback through two failovers.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	goredis "github.com/redis/go-redis/v9"
	"go.yaml.in/yaml/v3"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	sigsyaml "sigs.k8s.io/yaml"

	"github.com/encgate/encgate/fakeencoder"
	"github.com/encgate/encgate/gateway"
	"github.com/encgate/encgate/gpuagent"
	"github.com/encgate/encgate/internal/listener"
	"github.com/encgate/encgate/internal/redisclient"
	"github.com/encgate/encgate/internal/redistest"
	"github.com/encgate/encgate/internal/secretfile/secretfiletest"
	"github.com/encgate/encgate/internal/testtool"
)

const (
	// kubeDir is the kit, relative to this package.
	kubeDir = "kubernetes"
	// kubeImage is the image every encgate container names: what
	// `go run ./deploy/image` tags by default (deploy/image).
	kubeImage = "ghcr.io/encgate/encgate:dev"
	// kubeModuleRoot is the module root, relative to this package.
	kubeModuleRoot = ".."
)

// kubeServedPaths are the admin listener's open paths, the only ones a
// probe or a scrape may name (gateway/admin.go, gpuagent/agent.go).
var kubeServedPaths = []string{"/healthz", "/readyz", "/metrics"}

// kubeDoc is one decoded manifest document.
type kubeDoc struct {
	where string // file#index, for messages
	kind  string
	name  string
	ns    string
	obj   any // a pointer to the typed object
}

// kubeWorkload is a Deployment, DaemonSet or StatefulSet, reduced to what
// the checks need.
type kubeWorkload struct {
	kind, name string
	meta       *metav1.ObjectMeta
	replicas   *int32 // nil for a DaemonSet
	selector   *metav1.LabelSelector
	pod        *corev1.PodTemplateSpec
}

func (w kubeWorkload) String() string { return w.kind + "/" + w.name }

// kubeKit is the whole kit, decoded.
type kubeKit struct {
	namespace  string // kustomization.yaml's namespace
	docs       []kubeDoc
	workloads  []kubeWorkload
	services   []*corev1.Service
	configMaps map[string]*corev1.ConfigMap
	secrets    map[string]*corev1.Secret
	pdbs       []*policyv1.PodDisruptionBudget
	netpols    []*networkingv1.NetworkPolicy
}

// kubeKustomization is the part of kustomization.yaml the kit uses; any
// other key fails the strict decode (a typo such as "resource:" would
// otherwise leave the list empty without a word).
type kubeKustomization struct {
	APIVersion string   `json:"apiVersion"`
	Kind       string   `json:"kind"`
	Namespace  string   `json:"namespace"`
	Resources  []string `json:"resources"`
}

// kubeKinds maps each kind the kit may hold to its apiVersion and a
// constructor of its typed object. Any other kind fails the decode.
var kubeKinds = map[string]struct {
	apiVersion string
	obj        func() any
}{
	"Deployment":          {"apps/v1", func() any { return new(appsv1.Deployment) }},
	"DaemonSet":           {"apps/v1", func() any { return new(appsv1.DaemonSet) }},
	"StatefulSet":         {"apps/v1", func() any { return new(appsv1.StatefulSet) }},
	"Service":             {"v1", func() any { return new(corev1.Service) }},
	"ConfigMap":           {"v1", func() any { return new(corev1.ConfigMap) }},
	"Secret":              {"v1", func() any { return new(corev1.Secret) }},
	"Namespace":           {"v1", func() any { return new(corev1.Namespace) }},
	"PodDisruptionBudget": {"policy/v1", func() any { return new(policyv1.PodDisruptionBudget) }},
	"NetworkPolicy":       {"networking.k8s.io/v1", func() any { return new(networkingv1.NetworkPolicy) }},
}

// kubeStrictJSON decodes js into dst refusing unknown fields and trailing
// data.
func kubeStrictJSON(js []byte, dst any) error {
	dec := json.NewDecoder(bytes.NewReader(js))
	dec.DisallowUnknownFields()
	if err := dec.Decode(dst); err != nil {
		return err
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return fmt.Errorf("data after the object")
	}
	return nil
}

// kubeDocSep is a YAML document separator line.
var kubeDocSep = regexp.MustCompile(`(?m)^---[ \t]*(#.*)?$`)

// kubeDecodeDoc decodes one YAML document into the typed object its kind
// names. A document of comments only is nil, nil.
func kubeDecodeDoc(doc []byte) (*kubeDoc, error) {
	js, err := sigsyaml.YAMLToJSONStrict(doc)
	if err != nil {
		return nil, fmt.Errorf("YAML: %w", err)
	}
	if t := bytes.TrimSpace(js); len(t) == 0 || string(t) == "null" {
		return nil, nil
	}
	var tm metav1.TypeMeta
	if err := json.Unmarshal(js, &tm); err != nil {
		return nil, fmt.Errorf("not an object: %w", err)
	}
	k, ok := kubeKinds[tm.Kind]
	if !ok {
		return nil, fmt.Errorf("kind %q (apiVersion %q) is not one the kit may hold", tm.Kind, tm.APIVersion)
	}
	if tm.APIVersion != k.apiVersion {
		return nil, fmt.Errorf("%s has apiVersion %q, want %q", tm.Kind, tm.APIVersion, k.apiVersion)
	}
	obj := k.obj()
	if err := kubeStrictJSON(js, obj); err != nil {
		return nil, fmt.Errorf("%s: %w", tm.Kind, err)
	}
	meta := obj.(metav1.Object)
	if meta.GetName() == "" {
		return nil, fmt.Errorf("%s has no metadata.name", tm.Kind)
	}
	return &kubeDoc{kind: tm.Kind, name: meta.GetName(), ns: meta.GetNamespace(), obj: obj}, nil
}

// kubeDecodeStream splits data into YAML documents and decodes each.
func kubeDecodeStream(name string, data []byte) ([]kubeDoc, error) {
	var out []kubeDoc
	for i, part := range kubeDocSep.Split(string(data), -1) {
		d, err := kubeDecodeDoc([]byte(part))
		if err != nil {
			return nil, fmt.Errorf("%s, document %d: %w", name, i, err)
		}
		if d != nil {
			d.where = fmt.Sprintf("%s#%d", name, i)
			out = append(out, *d)
		}
	}
	return out, nil
}

// kubeReadKustomization reads and strictly decodes kustomization.yaml.
func kubeReadKustomization(t *testing.T) kubeKustomization {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(kubeDir, "kustomization.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	js, err := sigsyaml.YAMLToJSONStrict(data)
	if err != nil {
		t.Fatalf("kustomization.yaml: %v", err)
	}
	var k kubeKustomization
	if err := kubeStrictJSON(js, &k); err != nil {
		t.Fatalf("kustomization.yaml: %v", err)
	}
	if k.APIVersion != "kustomize.config.k8s.io/v1beta1" || k.Kind != "Kustomization" {
		t.Fatalf("kustomization.yaml is %s %s, want kustomize.config.k8s.io/v1beta1 Kustomization", k.APIVersion, k.Kind)
	}
	return k
}

// kubeLoad decodes every resource kustomization.yaml lists.
func kubeLoad(t *testing.T) *kubeKit {
	t.Helper()
	k := kubeReadKustomization(t)
	kit := &kubeKit{namespace: k.Namespace, configMaps: map[string]*corev1.ConfigMap{}, secrets: map[string]*corev1.Secret{}}
	seen := map[string]string{}
	for _, res := range k.Resources {
		data, err := os.ReadFile(filepath.Join(kubeDir, res))
		if err != nil {
			t.Fatalf("kustomization.yaml lists %s: %v", res, err)
		}
		docs, err := kubeDecodeStream(res, data)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range docs {
			id := d.kind + "/" + d.name
			if prev, dup := seen[id]; dup {
				t.Fatalf("%s is defined twice: %s and %s", id, prev, d.where)
			}
			seen[id] = d.where
			kit.docs = append(kit.docs, d)
			switch o := d.obj.(type) {
			case *appsv1.Deployment:
				kit.workloads = append(kit.workloads, kubeWorkload{d.kind, d.name, &o.ObjectMeta, o.Spec.Replicas, o.Spec.Selector, &o.Spec.Template})
			case *appsv1.DaemonSet:
				kit.workloads = append(kit.workloads, kubeWorkload{d.kind, d.name, &o.ObjectMeta, nil, o.Spec.Selector, &o.Spec.Template})
			case *appsv1.StatefulSet:
				kit.workloads = append(kit.workloads, kubeWorkload{d.kind, d.name, &o.ObjectMeta, o.Spec.Replicas, o.Spec.Selector, &o.Spec.Template})
			case *corev1.Service:
				kit.services = append(kit.services, o)
			case *corev1.ConfigMap:
				kit.configMaps[d.name] = o
			case *corev1.Secret:
				kit.secrets[d.name] = o
			case *policyv1.PodDisruptionBudget:
				kit.pdbs = append(kit.pdbs, o)
			case *networkingv1.NetworkPolicy:
				kit.netpols = append(kit.netpols, o)
			}
		}
	}
	return kit
}

func (kit *kubeKit) workload(t *testing.T, kind, name string) kubeWorkload {
	t.Helper()
	for _, w := range kit.workloads {
		if w.kind == kind && w.name == name {
			return w
		}
	}
	t.Fatalf("the kit has no %s/%s", kind, name)
	return kubeWorkload{}
}

func (kit *kubeKit) service(t *testing.T, name string) *corev1.Service {
	t.Helper()
	for _, s := range kit.services {
		if s.Name == name {
			return s
		}
	}
	t.Fatalf("the kit has no Service/%s", name)
	return nil
}

// kubeSelects reports whether the label selector sel matches labels. A nil
// or empty selector matches nothing here: the kit never means "everything".
func kubeSelects(t *testing.T, sel *metav1.LabelSelector, lbls map[string]string) bool {
	t.Helper()
	if sel == nil || (len(sel.MatchLabels) == 0 && len(sel.MatchExpressions) == 0) {
		return false
	}
	s, err := metav1.LabelSelectorAsSelector(sel)
	if err != nil {
		t.Fatalf("selector %v: %v", sel, err)
	}
	return s.Matches(labels.Set(lbls))
}

// kubeSubset reports whether every pair of sel is in labels (a Service's
// selector). An empty selector is false.
func kubeSubset(sel, labels map[string]string) bool {
	if len(sel) == 0 {
		return false
	}
	for k, v := range sel {
		if labels[k] != v {
			return false
		}
	}
	return true
}

// kubeIsEncgateImage reports whether image is some tag or digest of an
// encgate repository (the check then wants exactly kubeImage).
func kubeIsEncgateImage(image string) bool {
	repo := image
	if i := strings.Index(repo, "@"); i >= 0 {
		repo = repo[:i]
	}
	if i := strings.LastIndex(repo, ":"); i > strings.LastIndex(repo, "/") {
		repo = repo[:i]
	}
	return path.Base(repo) == "encgate"
}

// kubeContainers lists every container of a pod, init containers first.
func kubeContainers(ps *corev1.PodSpec) []*corev1.Container {
	var out []*corev1.Container
	for i := range ps.InitContainers {
		out = append(out, &ps.InitContainers[i])
	}
	for i := range ps.Containers {
		out = append(out, &ps.Containers[i])
	}
	return out
}

// kubeEncgateContainer is a container that runs the encgate image.
type kubeEncgateContainer struct {
	w    kubeWorkload
	c    *corev1.Container
	init bool
}

func (e kubeEncgateContainer) String() string { return e.w.String() + " container " + e.c.Name }

func (kit *kubeKit) encgateContainers() []kubeEncgateContainer {
	var out []kubeEncgateContainer
	for _, w := range kit.workloads {
		ps := &w.pod.Spec
		for i := range ps.InitContainers {
			if c := &ps.InitContainers[i]; kubeIsEncgateImage(c.Image) || kubeRunsSubcommand(c) {
				out = append(out, kubeEncgateContainer{w, c, true})
			}
		}
		for i := range ps.Containers {
			if c := &ps.Containers[i]; kubeIsEncgateImage(c.Image) || kubeRunsSubcommand(c) {
				out = append(out, kubeEncgateContainer{w, c, false})
			}
		}
	}
	return out
}

func kubeRunsSubcommand(c *corev1.Container) bool {
	return len(c.Args) > 0 && (c.Args[0] == "gateway" || c.Args[0] == "agent")
}

// kubeBuild builds the encgate binary from the module root.
func kubeBuild(t *testing.T) string {
	t.Helper()
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("the go command is needed to build encgate: %v", err)
	}
	bin := filepath.Join(t.TempDir(), "encgate")
	cmd := exec.Command(goBin, "build", "-o", bin, ".")
	cmd.Dir = kubeModuleRoot
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

// kubeFlags runs `encgate SUB -h` and returns the flags it defines, each
// with whether it takes a value (flag's usage prints "-name type" for those,
// "-name" for booleans). -h prints the usage to stdout and exits 0.
func kubeFlags(t *testing.T, bin, sub string) map[string]bool {
	t.Helper()
	var stdout bytes.Buffer
	cmd := exec.Command(bin, sub, "-h")
	cmd.Stdout = &stdout
	if err := cmd.Run(); err != nil {
		t.Fatalf("%s %s -h: %v", bin, sub, err)
	}
	if !strings.HasPrefix(stdout.String(), "usage: encgate "+sub) {
		t.Fatalf("encgate %s -h printed no flag usage: %q", sub, stdout.String())
	}
	flags := map[string]bool{}
	line := regexp.MustCompile(`^  -([A-Za-z0-9_.-]+)(?: (\S+))?$`)
	for l := range strings.SplitSeq(stdout.String(), "\n") {
		if m := line.FindStringSubmatch(l); m != nil {
			flags[m[1]] = m[2] != ""
		}
	}
	if len(flags) == 0 {
		t.Fatalf("no flags parsed from encgate %s -h: %q", sub, stdout.String())
	}
	return flags
}

// kubeParseArgs checks args (after the subcommand) against flags as Go's
// flag package parses them, and returns each flag's values.
func kubeParseArgs(args []string, flags map[string]bool) (map[string][]string, error) {
	got := map[string][]string{}
	for i := 0; i < len(args); i++ {
		a := args[i]
		if !strings.HasPrefix(a, "-") || a == "-" || a == "--" {
			return nil, fmt.Errorf("argument %q is not a flag (the subcommands take none)", a)
		}
		name := strings.TrimPrefix(strings.TrimPrefix(a, "-"), "-")
		name, value, hasValue := strings.Cut(name, "=")
		takesValue, ok := flags[name]
		switch {
		case !ok:
			return nil, fmt.Errorf("flag %q is not one the subcommand defines (it has %v)", a, slices.Sorted(maps.Keys(flags)))
		case takesValue && !hasValue:
			if i+1 == len(args) {
				return nil, fmt.Errorf("flag %q needs a value", a)
			}
			i++
			value = args[i]
		case !takesValue && !hasValue:
			value = "true"
		}
		got[name] = append(got[name], value)
	}
	return got, nil
}

// kubeFile is a file a container sees, resolved to the volume behind it.
type kubeFile struct {
	mount  corev1.VolumeMount
	volume corev1.Volume
	key    string // the ConfigMap or Secret key
	mode   int32  // the file's mode, for ConfigMap and Secret volumes
}

// kubeResolve finds which volume provides file p inside container c.
func kubeResolve(ps *corev1.PodSpec, c *corev1.Container, p string) (kubeFile, error) {
	var best *corev1.VolumeMount
	for i := range c.VolumeMounts {
		m := &c.VolumeMounts[i]
		if m.SubPath != "" {
			if p == m.MountPath {
				best = m
				break
			}
			continue
		}
		if strings.HasPrefix(p, strings.TrimSuffix(m.MountPath, "/")+"/") && (best == nil || len(m.MountPath) > len(best.MountPath)) {
			best = m
		}
	}
	if best == nil {
		return kubeFile{}, fmt.Errorf("no volumeMount provides %s", p)
	}
	rel := best.SubPath
	if rel == "" {
		rel = strings.TrimPrefix(p, strings.TrimSuffix(best.MountPath, "/")+"/")
	}
	f := kubeFile{mount: *best}
	i := slices.IndexFunc(ps.Volumes, func(v corev1.Volume) bool { return v.Name == best.Name })
	if i < 0 {
		return kubeFile{}, fmt.Errorf("volumeMount %s names no volume of the pod", best.Name)
	}
	f.volume = ps.Volumes[i]
	keyOf := func(items []corev1.KeyToPath, def *int32) (string, int32, error) {
		mode := int32(0o644) // the API's default for both volume kinds
		if def != nil {
			mode = *def
		}
		if len(items) == 0 {
			if strings.Contains(rel, "/") {
				return "", 0, fmt.Errorf("%s is not a key of volume %s", rel, best.Name)
			}
			return rel, mode, nil
		}
		for _, it := range items {
			if it.Path == rel {
				if it.Mode != nil {
					mode = *it.Mode
				}
				return it.Key, mode, nil
			}
		}
		return "", 0, fmt.Errorf("volume %s has no item with path %s", best.Name, rel)
	}
	var err error
	switch v := f.volume.VolumeSource; {
	case v.ConfigMap != nil:
		f.key, f.mode, err = keyOf(v.ConfigMap.Items, v.ConfigMap.DefaultMode)
	case v.Secret != nil:
		f.key, f.mode, err = keyOf(v.Secret.Items, v.Secret.DefaultMode)
	}
	return f, err
}

// configMapFile returns the content of a file a container reads from a
// ConfigMap of the kit.
func (kit *kubeKit) configMapFile(ps *corev1.PodSpec, c *corev1.Container, p string) (string, error) {
	f, err := kubeResolve(ps, c, p)
	if err != nil {
		return "", err
	}
	if f.volume.ConfigMap == nil {
		return "", fmt.Errorf("%s comes from volume %s, not from a ConfigMap", p, f.volume.Name)
	}
	cm, ok := kit.configMaps[f.volume.ConfigMap.Name]
	if !ok {
		return "", fmt.Errorf("%s: the kit has no ConfigMap %s", p, f.volume.ConfigMap.Name)
	}
	data, ok := cm.Data[f.key]
	if !ok {
		return "", fmt.Errorf("%s: ConfigMap %s has no key %s", p, cm.Name, f.key)
	}
	return data, nil
}

// kubeSecretRef is a key of one of the kit's Secrets, with its value.
type kubeSecretRef struct{ secret, key, value string }

// secretValue is the value of key in the kit's Secret name.
func (kit *kubeKit) secretValue(name, key string) (kubeSecretRef, error) {
	s, ok := kit.secrets[name]
	if !ok {
		return kubeSecretRef{}, fmt.Errorf("the kit has no Secret %s", name)
	}
	value, ok := s.StringData[key]
	if !ok {
		b, ok := s.Data[key]
		if !ok {
			return kubeSecretRef{}, fmt.Errorf("Secret %s has no key %s", name, key)
		}
		value = string(b)
	}
	return kubeSecretRef{name, key, value}, nil
}

// checkSecretFile checks that secret file p (a token or password file)
// comes from a Secret of the kit, with a key it holds, in a mode that the
// secret file reader accepts (nothing for others) and that the container's
// user can read (group, via fsGroup: the kubelet writes the files as root).
// It returns the Secret's key and value.
func (kit *kubeKit) checkSecretFile(ps *corev1.PodSpec, c *corev1.Container, p string) (kubeSecretRef, error) {
	f, err := kubeResolve(ps, c, p)
	if err != nil {
		return kubeSecretRef{}, err
	}
	if f.volume.Secret == nil {
		return kubeSecretRef{}, fmt.Errorf("%s comes from volume %s, not from a Secret", p, f.volume.Name)
	}
	ref, err := kit.secretValue(f.volume.Secret.SecretName, f.key)
	if err != nil {
		return kubeSecretRef{}, fmt.Errorf("%s: %w", p, err)
	}
	if f.mount.SubPath != "" {
		return kubeSecretRef{}, fmt.Errorf("%s is mounted with subPath %s: the kubelet never updates such a file, so a changed Secret would not reach it", p, f.mount.SubPath)
	}
	if f.mode&0o007 != 0 {
		return kubeSecretRef{}, fmt.Errorf("%s has mode %04o: the secret file reader refuses a file others may read (set defaultMode: 0440)", p, f.mode)
	}
	if f.mode&0o040 == 0 || ps.SecurityContext == nil || ps.SecurityContext.FSGroup == nil {
		return kubeSecretRef{}, fmt.Errorf("%s has mode %04o and the pod fsGroup %v: a root-owned file the non-root user cannot read", p, f.mode, kubeFSGroup(ps))
	}
	return ref, nil
}

func kubeFSGroup(ps *corev1.PodSpec) any {
	if ps.SecurityContext == nil || ps.SecurityContext.FSGroup == nil {
		return "unset"
	}
	return *ps.SecurityContext.FSGroup
}

// kubeSetYAML sets the scalar at a dotted path ("control.token_file",
// "encoders.0.agent_token_file") of a YAML document to value, as a string.
func kubeSetYAML(t *testing.T, src string, sets map[string]string) string {
	t.Helper()
	nodes := make(map[string]*yaml.Node, len(sets))
	for p, value := range sets {
		nodes[p] = &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!str", Value: value, Style: yaml.DoubleQuotedStyle}
	}
	return kubeSetYAMLNodes(t, src, nodes)
}

// kubeYAMLValue is the node of a YAML value written as text ("[a, b]"),
// for kubeSetYAMLNodes.
func kubeYAMLValue(t *testing.T, text string) *yaml.Node {
	t.Helper()
	var doc yaml.Node
	if err := yaml.Unmarshal([]byte(text), &doc); err != nil || len(doc.Content) != 1 {
		t.Fatalf("YAML value %q: %v", text, err)
	}
	return doc.Content[0]
}

// kubeYAMLJSON is the node of v written as JSON (which YAML reads), for
// kubeSetYAMLNodes.
func kubeYAMLJSON(t *testing.T, v any) *yaml.Node {
	t.Helper()
	js, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return kubeYAMLValue(t, string(js))
}

// kubeSetYAMLNodes replaces the value at each dotted path of a YAML
// document (which must exist) with the node given.
func kubeSetYAMLNodes(t *testing.T, src string, sets map[string]*yaml.Node) string {
	t.Helper()
	var doc yaml.Node
	if err := yaml.Unmarshal([]byte(src), &doc); err != nil {
		t.Fatal(err)
	}
	for p, value := range sets {
		n := doc.Content[0]
		for seg := range strings.SplitSeq(p, ".") {
			var next *yaml.Node
			switch n.Kind {
			case yaml.MappingNode:
				for i := 0; i+1 < len(n.Content); i += 2 {
					if n.Content[i].Value == seg {
						next = n.Content[i+1]
					}
				}
			case yaml.SequenceNode:
				if i, err := strconv.Atoi(seg); err == nil && i >= 0 && i < len(n.Content) {
					next = n.Content[i]
				}
			}
			if next == nil {
				t.Fatalf("the config has no %s", p)
			}
			n = next
		}
		*n = *value
	}
	out, err := yaml.Marshal(&doc)
	if err != nil {
		t.Fatal(err)
	}
	return string(out)
}

// kubeSecretFiles lists the secret files (tokens, the Redis password) a
// loaded config reads, by the YAML path that names each.
func kubeSecretFiles(sub string, cfg any) map[string]string {
	out := map[string]string{}
	switch sub {
	case "gateway":
		c := cfg.(gateway.Config)
		for i, e := range c.Encoders {
			if e.AgentTokenFile != "" {
				out[fmt.Sprintf("encoders.%d.agent_token_file", i)] = e.AgentTokenFile
			}
		}
		if f := c.Admin.TokenFile; f != "" {
			out["admin.token_file"] = f
		}
		if f := c.Bootstrap.TokenFile; f != "" {
			out["bootstrap.token_file"] = f
		}
		if f := c.Redis.PasswordFile; f != "" {
			out["redis.password_file"] = f
		}
		if f := c.Redis.SentinelPasswordFile; f != "" {
			out["redis.sentinel_password_file"] = f
		}
	case "agent":
		if f := cfg.(gpuagent.Config).Control.TokenFile; f != "" {
			out["control.token_file"] = f
		}
	}
	return out
}

// kubeTestToken is what the test writes into the secret files it makes:
// a valid token, and the password of the test's Redis.
const kubeTestToken = "kube-test-token-0123456789abcdef"

// kubeFieldPath is the field path a config error names for YAML path yp
// ("encoders.0.agent_token_file" is encoders[0].agent_token_file).
func kubeFieldPath(yp string) string {
	return regexp.MustCompile(`\.([0-9]+)`).ReplaceAllString(yp, "[$1]")
}

// kubeLoadConfig writes content to a temp file and loads it with the
// subcommand's loader.
func kubeLoadConfig(t *testing.T, sub, content string) (any, error) {
	t.Helper()
	p := filepath.Join(t.TempDir(), sub+".yaml")
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	if sub == "gateway" {
		return gateway.LoadConfig(p)
	}
	return gpuagent.LoadConfig(p)
}

// kubeLocalConfig is a container's config, ready to load on this machine:
// every secret file it reads is rewritten to a file of mode 0600 in a temp
// dir holding kubeTestToken, after checking that the Secret behind it is
// mounted right; sets rewrites more keys (addresses, for a live run).
func (kit *kubeKit) localConfig(t *testing.T, e kubeEncgateContainer, content string, sets map[string]string) (string, any) {
	t.Helper()
	sub := e.c.Args[0]
	first, _ := kubeLoadConfig(t, sub, content) // may fail on the missing secret files
	all := map[string]string{}
	for yp, file := range kubeSecretFiles(sub, first) {
		if _, err := kit.checkSecretFile(&e.w.pod.Spec, e.c, file); err != nil {
			t.Errorf("%s: %s (%s): %v", e, yp, file, err)
		}
		all[yp] = secretfiletest.Write(t, "secret", kubeTestToken+"\n", 0o600)
	}
	for k, v := range sets {
		all[k] = v
	}
	if len(all) > 0 {
		content = kubeSetYAML(t, content, all)
	}
	cfg, err := kubeLoadConfig(t, sub, content)
	if err != nil {
		t.Fatalf("%s: its config does not load: %v", e, err)
	}
	return content, cfg
}

// kubeAddrs is what a loaded config binds.
type kubeAddrs struct{ listen, admin string }

func kubeAddrsOf(sub string, cfg any) kubeAddrs {
	if sub == "gateway" {
		c := cfg.(gateway.Config)
		return kubeAddrs{c.Listen, c.AdminListen}
	}
	c := cfg.(gpuagent.Config)
	return kubeAddrs{c.Listen, c.AdminListen}
}

// kubePort is the port of a host:port.
func kubePort(t *testing.T, addr string) (host string, port int32) {
	t.Helper()
	h, p, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatalf("address %q: %v", addr, err)
	}
	n, err := strconv.ParseInt(p, 10, 32)
	if err != nil {
		t.Fatalf("address %q: %v", addr, err)
	}
	return h, int32(n)
}

// kubeProbePort resolves a probe's port, a number or a container port's
// name.
func kubeProbePort(c *corev1.Container, p intstr.IntOrString) (int32, error) {
	if p.Type == intstr.Int {
		return p.IntVal, nil
	}
	for _, cp := range c.Ports {
		if cp.Name == p.StrVal {
			return cp.ContainerPort, nil
		}
	}
	return 0, fmt.Errorf("no container port named %q", p.StrVal)
}

// kubeProbeWindow is how long a failing readiness probe takes to take the
// pod out: periodSeconds x failureThreshold (the API's defaults 10 and 3).
func kubeProbeWindow(p *corev1.Probe) time.Duration {
	period, failures := p.PeriodSeconds, p.FailureThreshold
	if period == 0 {
		period = 10
	}
	if failures == 0 {
		failures = 3
	}
	return time.Duration(period*failures) * time.Second
}

func kubeGrace(ps *corev1.PodSpec) time.Duration {
	if ps.TerminationGracePeriodSeconds == nil {
		return 30 * time.Second // the API's default
	}
	return time.Duration(*ps.TerminationGracePeriodSeconds) * time.Second
}

// TestKubeKustomizationListsEveryManifest: every resource the
// kustomization lists exists, and every file of the kit is listed; a
// directory is an add-on with a kustomization of its own.
func TestKubeKustomizationListsEveryManifest(t *testing.T) {
	k := kubeReadKustomization(t)
	if len(k.Resources) == 0 {
		t.Fatal("kustomization.yaml lists no resources")
	}
	listed := map[string]bool{}
	for _, r := range k.Resources {
		if listed[r] {
			t.Errorf("kustomization.yaml lists %s twice", r)
		}
		listed[r] = true
		if fi, err := os.Stat(filepath.Join(kubeDir, r)); err != nil || !fi.Mode().IsRegular() {
			t.Errorf("kustomization.yaml lists %s, which is not a file of %s: %v", r, kubeDir, err)
		}
	}
	entries, err := os.ReadDir(kubeDir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if e.Name() == "kustomization.yaml" {
			continue
		}
		if e.IsDir() {
			// An add-on with a kustomization of its own
			// (prometheus-operator: kubernetes_operator_test.go).
			if _, err := os.Stat(filepath.Join(kubeDir, e.Name(), "kustomization.yaml")); err != nil {
				t.Errorf("%s/%s is a directory without a kustomization.yaml", kubeDir, e.Name())
			}
			continue
		}
		if !listed[e.Name()] {
			t.Errorf("%s/%s is not in kustomization.yaml's resources", kubeDir, e.Name())
		}
	}
	if k.Namespace == "" {
		t.Error("kustomization.yaml sets no namespace")
	}
}

// TestKubeDecoderIsStrict: the decoder the other tests rely on refuses an
// unknown field, an unknown kind, a wrong apiVersion and a repeated key.
func TestKubeDecoderIsStrict(t *testing.T) {
	good := "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\nspec:\n  replicas: 2\n"
	if docs, err := kubeDecodeStream("good", []byte("# c\n---\n"+good+"---\n")); err != nil || len(docs) != 1 {
		t.Fatalf("a plain Deployment: %v, %d documents", err, len(docs))
	}
	for name, doc := range map[string]string{
		"unknown field": strings.Replace(good, "replicas", "replica", 1),
		"unknown kind":  "apiVersion: v1\nkind: Pod\nmetadata: {name: x}\n",
		"wrong version": strings.Replace(good, "apps/v1", "apps/v1beta1", 1),
		"repeated key":  good + "  replicas: 3\n",
		"no name":       "apiVersion: v1\nkind: ConfigMap\nmetadata: {}\n",
	} {
		if _, err := kubeDecodeStream(name, []byte(doc)); err == nil {
			t.Errorf("%s: decoded without an error", name)
		}
	}
}

// TestKubeManifestsDecodeStrictly: every document of every listed file is
// one of the kit's kinds and decodes into its API type with no unknown
// field; none sets a namespace other than the kustomization's.
func TestKubeManifestsDecodeStrictly(t *testing.T) {
	kit := kubeLoad(t)
	kinds := map[string]int{}
	for _, d := range kit.docs {
		kinds[d.kind]++
		if d.ns != "" && d.ns != kit.namespace {
			t.Errorf("%s: %s/%s is in namespace %q, the kustomization puts everything in %q", d.where, d.kind, d.name, d.ns, kit.namespace)
		}
		if ns, ok := d.obj.(*corev1.Namespace); ok && ns.Name != kit.namespace {
			t.Errorf("%s: Namespace %s is not the kustomization's namespace %s", d.where, ns.Name, kit.namespace)
		}
	}
	for _, k := range []string{"Deployment", "DaemonSet", "Service", "ConfigMap", "Secret", "PodDisruptionBudget"} {
		if kinds[k] == 0 {
			t.Errorf("the kit has no %s", k)
		}
	}
	for _, w := range kit.workloads {
		if !kubeSelects(t, w.selector, w.pod.Labels) {
			t.Errorf("%s: its selector %v does not match its pod template's labels %v", w, w.selector, w.pod.Labels)
		}
	}
}

// TestKubeEncgateContainers: every container of the encgate image names it
// exactly, runs `gateway` or `agent` with flags that subcommand defines,
// reads a config from a ConfigMap that the subcommand's loader (and its
// --check) accepts, probes paths the admin listener serves on the port the
// config's admin_listen binds, and publishes the ports its config listens
// on.
func TestKubeEncgateContainers(t *testing.T) {
	kit := kubeLoad(t)
	bin := kubeBuild(t)
	flags := map[string]map[string]bool{"gateway": kubeFlags(t, bin, "gateway"), "agent": kubeFlags(t, bin, "agent")}
	runs := map[string][]string{}
	for _, e := range kit.encgateContainers() {
		t.Run(e.w.name+"/"+e.c.Name, func(t *testing.T) {
			c, ps := e.c, &e.w.pod.Spec
			if c.Image != kubeImage {
				t.Errorf("image %q, want %q (what deploy/image builds)", c.Image, kubeImage)
			}
			if e.init {
				t.Fatalf("an init container runs the encgate image")
			}
			if len(c.Command) != 0 {
				t.Errorf("command %q: the image's entrypoint is /encgate; give the subcommand in args", c.Command)
			}
			if !kubeRunsSubcommand(c) {
				t.Fatalf("args %q: the first must be gateway or agent", c.Args)
			}
			sub := c.Args[0]
			runs[sub] = append(runs[sub], e.String())
			got, err := kubeParseArgs(c.Args[1:], flags[sub])
			if err != nil {
				t.Fatalf("args %q: %v", c.Args, err)
			}
			if got["check"] != nil {
				t.Errorf("args %q: --check validates and exits", c.Args)
			}
			if len(got["config"]) != 1 {
				t.Fatalf("args %q: want --config once", c.Args)
			}
			configPath := got["config"][0]
			content, err := kit.configMapFile(ps, c, configPath)
			if err != nil {
				t.Fatalf("--config %s: %v", configPath, err)
			}
			local, cfg := kit.localConfig(t, e, content, nil)

			// The same loader through the binary's --check.
			p := filepath.Join(t.TempDir(), sub+".yaml")
			if err := os.WriteFile(p, []byte(local), 0o600); err != nil {
				t.Fatal(err)
			}
			out, err := exec.Command(bin, sub, "--config", p, "--check").CombinedOutput()
			if err != nil {
				var tooSmall *listener.DescriptorError
				if sub == "gateway" {
					if _, derr := gateway.Descriptors(cfg.(gateway.Config), nil, false); errors.As(derr, &tooSmall) {
						t.Logf("--check refused the config on this machine's RLIMIT_NOFILE only: %s", out)
						err = nil
					}
				}
				if err != nil {
					t.Errorf("encgate %s --config (the ConfigMap's) --check: %v\n%s", sub, err, out)
				}
			}

			// Every address the config binds is reachable from the kubelet
			// and the Services (not loopback), and published as a port.
			addrs := kubeAddrsOf(sub, cfg)
			published := map[int32]bool{}
			for _, cp := range c.Ports {
				published[cp.ContainerPort] = true
			}
			binds := []string{addrs.listen, addrs.admin}
			if sub == "gateway" {
				if b := cfg.(gateway.Config).Bootstrap.Listen; b != "" {
					binds = append(binds, b)
				}
			}
			for _, a := range binds {
				host, port := kubePort(t, a)
				if ip := net.ParseIP(host); host != "" && (ip == nil || !ip.IsUnspecified()) {
					t.Errorf("the config binds %s: only the pod itself reaches it; bind 0.0.0.0", a)
				}
				if !published[port] {
					t.Errorf("the config listens on %s, but no containerPort is %d", a, port)
				}
			}
			_, adminPort := kubePort(t, addrs.admin)

			probes := map[string]*corev1.Probe{"readinessProbe": c.ReadinessProbe, "livenessProbe": c.LivenessProbe, "startupProbe": c.StartupProbe}
			for name, want := range map[string]string{"readinessProbe": "/readyz", "livenessProbe": "/healthz"} {
				pr := probes[name]
				if pr == nil || pr.HTTPGet == nil {
					t.Errorf("no %s with httpGet", name)
					continue
				}
				if pr.HTTPGet.Path != want {
					t.Errorf("%s on %s, want %s", name, pr.HTTPGet.Path, want)
				}
			}
			for name, pr := range probes {
				if pr == nil {
					continue
				}
				if pr.HTTPGet == nil {
					t.Errorf("%s is not an httpGet probe", name)
					continue
				}
				if !slices.Contains(kubeServedPaths, pr.HTTPGet.Path) {
					t.Errorf("%s on %s: the admin listener serves %v without a token", name, pr.HTTPGet.Path, kubeServedPaths)
				}
				port, err := kubeProbePort(c, pr.HTTPGet.Port)
				if err != nil {
					t.Errorf("%s: %v", name, err)
				} else if port != adminPort {
					t.Errorf("%s on port %d, but admin_listen is %s", name, port, addrs.admin)
				}
				if s := pr.HTTPGet.Scheme; s != "" && s != corev1.URISchemeHTTP {
					t.Errorf("%s scheme %s: the admin listener is plain HTTP", name, s)
				}
			}
			if a := e.w.pod.Annotations; a["prometheus.io/scrape"] == "true" {
				if a["prometheus.io/port"] != strconv.Itoa(int(adminPort)) {
					t.Errorf("prometheus.io/port %q, but admin_listen is %s", a["prometheus.io/port"], addrs.admin)
				}
				if p := a["prometheus.io/path"]; p != "/metrics" {
					t.Errorf("prometheus.io/path %q, want /metrics", p)
				}
			}

			switch sub {
			case "gateway":
				g := cfg.(gateway.Config)
				if c.ReadinessProbe == nil {
					break
				}
				ready := kubeProbeWindow(c.ReadinessProbe)
				if d := g.Shutdown.Delay.D(); d < ready {
					t.Errorf("shutdown.delay %s is shorter than the readiness probe's periodSeconds x failureThreshold (%s): the pod still gets traffic when its listener closes", d, ready)
				}
				if tg, need := kubeGrace(ps), g.Shutdown.Delay.D()+g.Shutdown.Grace.D(); tg <= need {
					t.Errorf("terminationGracePeriodSeconds %s is not above shutdown.delay + shutdown.grace (%s): the kubelet kills a drain within its grace", tg, need)
				}
			case "agent":
				a := cfg.(gpuagent.Config)
				if tg := kubeGrace(ps); tg <= a.Shutdown.Grace.D() {
					t.Errorf("terminationGracePeriodSeconds %s is not above shutdown.grace %s", tg, a.Shutdown.Grace.D())
				}
				limit := c.Resources.Limits[corev1.ResourceMemory]
				if limit.IsZero() || limit.Value() <= int64(a.Staging.CapacityBytes) {
					t.Errorf("memory limit %s is not above staging.capacity_bytes %s: the staged embeddings are the agent's own memory", limit.String(), a.Staging.CapacityBytes)
				}
				kubeCheckSocketDir(t, ps, c, a.Control.Socket)
			}
		})
	}
	if len(runs["gateway"]) != 1 || len(runs["agent"]) != 1 {
		t.Errorf("want one gateway and one agent container, got %v", runs)
	}
}

// kubeCheckSocketDir checks that the agent's control socket is in a
// writable hostPath directory: the node's encoder pods reach it there.
func kubeCheckSocketDir(t *testing.T, ps *corev1.PodSpec, c *corev1.Container, socket string) {
	t.Helper()
	f, err := kubeResolve(ps, c, socket)
	if err != nil {
		t.Errorf("control.socket %s: %v", socket, err)
		return
	}
	hp := f.volume.HostPath
	if hp == nil || filepath.Dir(socket) != filepath.Clean(f.mount.MountPath) {
		t.Errorf("control.socket %s is not directly in a hostPath mount (volume %s at %s): the encoder pods on the node cannot reach it", socket, f.volume.Name, f.mount.MountPath)
		return
	}
	if f.mount.ReadOnly {
		t.Errorf("control.socket's directory %s is mounted read-only: the agent binds the socket there", f.mount.MountPath)
	}
	if hp.Type == nil || (*hp.Type != corev1.HostPathDirectoryOrCreate && *hp.Type != corev1.HostPathDirectory) {
		t.Errorf("hostPath %s has type %v, want DirectoryOrCreate or Directory", hp.Path, hp.Type)
	}
	// The kubelet creates the directory as root: an init container must
	// hand it to the agent's user before the agent binds there.
	uid := kubeRunAsUser(ps, c)
	handed := false
	for _, ic := range ps.InitContainers {
		mounted := slices.ContainsFunc(ic.VolumeMounts, func(m corev1.VolumeMount) bool {
			return m.Name == f.volume.Name && !m.ReadOnly
		})
		if mounted && len(ic.Command) >= 3 && ic.Command[0] == "chown" && slices.Contains(ic.Command, hp.Path) && uid != nil &&
			strings.HasPrefix(ic.Command[1], strconv.FormatInt(*uid, 10)+":") {
			handed = true
		}
	}
	if !handed {
		t.Errorf("no init container chowns %s to the agent's uid %v", hp.Path, uid)
	}
}

func kubeRunAsUser(ps *corev1.PodSpec, c *corev1.Container) *int64 {
	if c.SecurityContext != nil && c.SecurityContext.RunAsUser != nil {
		return c.SecurityContext.RunAsUser
	}
	if ps.SecurityContext != nil {
		return ps.SecurityContext.RunAsUser
	}
	return nil
}

// kubeLinterIgnore is the annotation prefix by which kube-linter skips a
// check for one object; the value is the reason.
const kubeLinterIgnore = "ignore-check.kube-linter.io/"

// kubeLinterIgnored reports whether workload w tells kube-linter to skip
// check, with a reason.
func kubeLinterIgnored(w kubeWorkload, check string) bool {
	return strings.TrimSpace(w.meta.Annotations[kubeLinterIgnore+check]) != ""
}

// TestKubeEveryContainerIsLockedDown: every container, init containers
// included, has CPU and memory requests and a memory limit, a read-only
// root filesystem, no privilege escalation, no capabilities, the runtime's
// seccomp profile, and runs as a non-root user; encgate's as 65532. The
// one exception: an init container may run as root with CHOWN alone (the
// agent's socket directory), in a workload that tells kube-linter why
// (ignore-check.kube-linter.io/run-as-non-root). No pod shares the node's
// network, PIDs or IPC.
//
// kube-linter cannot run here (it is no Go module this repository may
// fetch), so this stands in for its checks unset-cpu-requirements,
// unset-memory-requirements, run-as-non-root, no-read-only-root-fs,
// privilege-escalation-container, privileged-container,
// drop-net-raw-capability (ALL is dropped), host-network, host-pid and
// host-ipc, and for the "restricted" Pod Security Standard's seccomp rule.
// CPU limits are left unset on purpose: a CFS quota throttles a
// latency-bound process under a burst (kube-linter's CPU check asks for
// requests only).
func TestKubeEveryContainerIsLockedDown(t *testing.T) {
	kit := kubeLoad(t)
	for _, w := range kit.workloads {
		ps := &w.pod.Spec
		if ps.HostNetwork || ps.HostPID || ps.HostIPC {
			t.Errorf("%s shares the node's network, PIDs or IPC", w)
		}
		if ps.AutomountServiceAccountToken == nil || *ps.AutomountServiceAccountToken {
			t.Errorf("%s mounts a service account token; nothing in the kit talks to the API", w)
		}
		inits := map[string]bool{}
		for _, ic := range ps.InitContainers {
			inits[ic.Name] = true
		}
		for _, c := range kubeContainers(ps) {
			where := fmt.Sprintf("%s container %s", w, c.Name)
			for _, r := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
				if q, ok := c.Resources.Requests[r]; !ok || q.Cmp(resource.MustParse("0")) <= 0 {
					t.Errorf("%s: no %s request", where, r)
				}
			}
			if q, ok := c.Resources.Limits[corev1.ResourceMemory]; !ok || q.Cmp(c.Resources.Requests[corev1.ResourceMemory]) < 0 {
				t.Errorf("%s: no memory limit at or above its request", where)
			}
			sc := c.SecurityContext
			if sc == nil {
				t.Errorf("%s: no securityContext", where)
				continue
			}
			if sc.Privileged != nil && *sc.Privileged {
				t.Errorf("%s is privileged", where)
			}
			if sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
				t.Errorf("%s: readOnlyRootFilesystem is not true", where)
			}
			if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
				t.Errorf("%s: allowPrivilegeEscalation is not false", where)
			}
			var added []corev1.Capability
			if sc.Capabilities == nil || !slices.Contains(sc.Capabilities.Drop, "ALL") {
				t.Errorf("%s: capabilities do not drop ALL", where)
			} else {
				added = sc.Capabilities.Add
			}
			seccomp := sc.SeccompProfile
			if seccomp == nil && ps.SecurityContext != nil {
				seccomp = ps.SecurityContext.SeccompProfile
			}
			if seccomp == nil || seccomp.Type != corev1.SeccompProfileTypeRuntimeDefault {
				t.Errorf("%s: seccompProfile is not RuntimeDefault", where)
			}
			nonRoot := sc.RunAsNonRoot
			if nonRoot == nil && ps.SecurityContext != nil {
				nonRoot = ps.SecurityContext.RunAsNonRoot
			}
			uid := kubeRunAsUser(ps, c)
			chownOnly := inits[c.Name] && slices.Equal(added, []corev1.Capability{"CHOWN"})
			switch {
			case chownOnly && uid != nil && *uid == 0:
				// The socket directory's init container: root, CHOWN only,
				// and the workload says why.
				for _, check := range []string{"run-as-non-root", "init-container-security-gap"} {
					if !kubeLinterIgnored(w, check) {
						t.Errorf("%s runs as root without the annotation %s%s giving the reason", where, kubeLinterIgnore, check)
					}
				}
			case len(added) > 0:
				t.Errorf("%s adds capabilities %v", where, added)
				fallthrough
			default:
				if nonRoot == nil || !*nonRoot {
					t.Errorf("%s: runAsNonRoot is not true", where)
				}
				if uid == nil || *uid == 0 {
					t.Errorf("%s: no non-root runAsUser", where)
				}
			}
			if kubeIsEncgateImage(c.Image) && (uid == nil || *uid != 65532) {
				t.Errorf("%s: runAsUser %v, want 65532 (the image's user)", where, uid)
			}
		}
	}
}

// kubeSecretName matches an environment variable's name that says it holds
// a secret: kube-linter's env-var-secret pattern (secret) and the kit's own
// words for one (password, token).
var kubeSecretName = regexp.MustCompile(`(?i)secret|passw|token`)

// TestKubeNoSecretInEnv: no container takes a secret through its
// environment, where every process it starts inherits it and
// /proc/PID/environ shows it. No env valueFrom secretKeyRef and no envFrom
// secretRef (kube-linter's read-secret-from-env-var); a variable named like
// a secret (env-var-secret) may hold a literal only when that literal is
// the path of a file mounted from a Secret (REDIS_PASSWORD_FILE), which the
// process reads itself.
func TestKubeNoSecretInEnv(t *testing.T) {
	kit := kubeLoad(t)
	checked := 0
	for _, w := range kit.workloads {
		ps := &w.pod.Spec
		for _, c := range kubeContainers(ps) {
			where := fmt.Sprintf("%s container %s", w, c.Name)
			for _, ef := range c.EnvFrom {
				if ef.SecretRef != nil {
					t.Errorf("%s: envFrom Secret %s puts every key of it in the environment; mount it as files", where, ef.SecretRef.Name)
				}
			}
			for _, ev := range c.Env {
				checked++
				if ev.ValueFrom != nil && ev.ValueFrom.SecretKeyRef != nil {
					t.Errorf("%s: env %s comes from Secret %s key %s; mount the Secret and read the file", where, ev.Name, ev.ValueFrom.SecretKeyRef.Name, ev.ValueFrom.SecretKeyRef.Key)
					continue
				}
				if ev.ValueFrom != nil || !kubeSecretName.MatchString(ev.Name) {
					continue
				}
				f, err := kubeResolve(ps, c, ev.Value)
				switch {
				case err != nil:
					t.Errorf("%s: env %s is named like a secret and holds a literal that is no mounted file (%v): a secret written in the manifest", where, ev.Name, err)
				case f.volume.Secret == nil:
					t.Errorf("%s: env %s names %s, which comes from volume %s, not from a Secret", where, ev.Name, ev.Value, f.volume.Name)
				}
			}
		}
	}
	if checked == 0 {
		t.Fatal("no container of the kit sets an environment variable: the check checked nothing")
	}
}

// TestKubeLinterIgnoresGiveReasons: the kit tells kube-linter to skip a
// check only where this file knows why, and says why in the annotation's
// value: the agent's root init container (run-as-non-root and
// init-container-security-gap, see TestKubeEveryContainerIsLockedDown) and
// its socket's hostPath (writable-host-mount, see kubeCheckSocketDir),
// which every workload with a writable hostPath mount must carry.
func TestKubeLinterIgnoresGiveReasons(t *testing.T) {
	kit := kubeLoad(t)
	for _, w := range kit.workloads {
		ps := &w.pod.Spec
		for _, c := range kubeContainers(ps) {
			for _, m := range c.VolumeMounts {
				i := slices.IndexFunc(ps.Volumes, func(v corev1.Volume) bool { return v.Name == m.Name })
				if i >= 0 && ps.Volumes[i].HostPath != nil && !m.ReadOnly && !kubeLinterIgnored(w, "writable-host-mount") {
					t.Errorf("%s container %s mounts hostPath %s writable without the annotation %swritable-host-mount giving the reason", w, c.Name, ps.Volumes[i].HostPath.Path, kubeLinterIgnore)
				}
			}
		}
	}
	allowed := map[string][]string{"DaemonSet/encgate-agent": {"run-as-non-root", "init-container-security-gap", "writable-host-mount"}}
	for _, d := range kit.docs {
		meta := d.obj.(metav1.Object)
		for k, v := range meta.GetAnnotations() {
			check, ok := strings.CutPrefix(k, kubeLinterIgnore)
			if !ok {
				continue
			}
			id := d.kind + "/" + d.name
			if !slices.Contains(allowed[id], check) {
				t.Errorf("%s: %s skips kube-linter's %s, which the kit is meant to pass", d.where, id, check)
			}
			if len(strings.Fields(v)) < 5 {
				t.Errorf("%s: %s's annotation %s gives no reason (%q)", d.where, id, k, v)
			}
		}
	}
}

// TestKubePodDisruptionBudgetsSayWhatUnhealthyPodsGet: every
// PodDisruptionBudget writes its unhealthyPodEvictionPolicy (kube-linter's
// pdb-unhealthy-pod-eviction-policy): whether a drain may evict a pod that
// is not ready is a choice, made per workload.
func TestKubePodDisruptionBudgetsSayWhatUnhealthyPodsGet(t *testing.T) {
	kit := kubeLoad(t)
	if len(kit.pdbs) == 0 {
		t.Fatal("the kit has no PodDisruptionBudget")
	}
	for _, pdb := range kit.pdbs {
		if pdb.Spec.UnhealthyPodEvictionPolicy == nil {
			t.Errorf("PodDisruptionBudget %s does not set unhealthyPodEvictionPolicy", pdb.Name)
		}
	}
}

// TestKubeReplicasPreferTwoNodes: every workload of two replicas or more
// (the gateway's Deployment, Redis's StatefulSet) has a pod anti-affinity
// term by node that selects its own pods, so that the scheduler puts the
// replicas on different nodes where it can (kube-linter's
// no-anti-affinity); preferred, not required, so that a cluster of fewer
// nodes, or a rolling update's surge pod, still gets scheduled. A topology
// spread, where there is one, selects the workload's own pods too.
func TestKubeReplicasPreferTwoNodes(t *testing.T) {
	kit := kubeLoad(t)
	checked := 0
	for _, w := range kit.workloads {
		if w.replicas == nil || *w.replicas < 2 {
			continue
		}
		checked++
		antiAffinity := false
		if a := w.pod.Spec.Affinity; a != nil && a.PodAntiAffinity != nil {
			for _, p := range a.PodAntiAffinity.PreferredDuringSchedulingIgnoredDuringExecution {
				term := p.PodAffinityTerm
				if term.TopologyKey == corev1.LabelHostname && len(term.Namespaces) == 0 && term.NamespaceSelector == nil &&
					kubeSelects(t, term.LabelSelector, w.pod.Labels) {
					antiAffinity = true
				}
			}
			if len(a.PodAntiAffinity.RequiredDuringSchedulingIgnoredDuringExecution) > 0 {
				t.Errorf("%s: a required pod anti-affinity leaves a replica (or a rolling update's surge pod) unscheduled on a cluster of too few nodes; prefer it", w)
			}
		}
		if !antiAffinity {
			t.Errorf("%s: no preferred pod anti-affinity term by %s selects its own pods: its replicas may share a node", w, corev1.LabelHostname)
		}
		for _, tsc := range w.pod.Spec.TopologySpreadConstraints {
			if !kubeSelects(t, tsc.LabelSelector, w.pod.Labels) {
				t.Errorf("%s: topologySpreadConstraint by %s selects other pods than its own", w, tsc.TopologyKey)
			}
		}
	}
	if checked < 2 {
		t.Errorf("checked %d workloads of several replicas, want the gateway's and Redis's", checked)
	}
}

// TestKubeGatewayDeployment: two replicas, rolled one at a time without
// going below them, a PodDisruptionBudget that selects exactly its pods and
// lets one go, and the Service of its encoder-facing port keeps a client on
// one replica (its follow-ups find their pin in that replica's own table,
// without a read from Redis).
func TestKubeGatewayDeployment(t *testing.T) {
	kit := kubeLoad(t)
	var gw *kubeWorkload
	for _, e := range kit.encgateContainers() {
		if kubeRunsSubcommand(e.c) && e.c.Args[0] == "gateway" {
			gw = &e.w
		}
	}
	if gw == nil || gw.kind != "Deployment" {
		t.Fatalf("the gateway does not run as a Deployment: %v", gw)
	}
	if gw.replicas == nil || *gw.replicas != 2 {
		t.Errorf("%s: replicas %s, want 2", gw, kubeCount(gw.replicas))
	}
	d := kit.docByName(t, "Deployment", gw.name).(*appsv1.Deployment)
	if ru := d.Spec.Strategy.RollingUpdate; ru == nil || ru.MaxUnavailable == nil || ru.MaxUnavailable.String() != "0" {
		t.Errorf("%s: a rolling update may take a replica down before its successor is ready (maxUnavailable %v)", gw, ru)
	}
	found := 0
	for _, pdb := range kit.pdbs {
		if !kubeSelects(t, pdb.Spec.Selector, gw.pod.Labels) {
			continue
		}
		found++
		for _, w := range kit.workloads {
			if w.name != gw.name && kubeSelects(t, pdb.Spec.Selector, w.pod.Labels) {
				t.Errorf("PodDisruptionBudget %s also selects %s", pdb.Name, w)
			}
		}
		switch {
		case pdb.Spec.MinAvailable != nil && pdb.Spec.MaxUnavailable == nil:
			n := pdb.Spec.MinAvailable
			if n.Type != intstr.Int || n.IntVal < 1 || gw.replicas == nil || n.IntVal >= *gw.replicas {
				t.Errorf("PodDisruptionBudget %s: minAvailable %s of %s replicas: want at least 1 and fewer than all (or no drain can ever proceed)", pdb.Name, n.String(), kubeCount(gw.replicas))
			}
		case pdb.Spec.MaxUnavailable != nil && pdb.Spec.MinAvailable == nil:
			if n := pdb.Spec.MaxUnavailable; n.Type != intstr.Int || n.IntVal != 1 {
				t.Errorf("PodDisruptionBudget %s: maxUnavailable %s, want 1", pdb.Name, n.String())
			}
		default:
			t.Errorf("PodDisruptionBudget %s: set exactly one of minAvailable and maxUnavailable", pdb.Name)
		}
	}
	if found != 1 {
		t.Errorf("%d PodDisruptionBudgets select the gateway's pods %v, want 1", found, gw.pod.Labels)
	}
	for _, s := range kit.services {
		if kubeSubset(s.Spec.Selector, gw.pod.Labels) && slices.ContainsFunc(s.Spec.Ports, func(p corev1.ServicePort) bool { return p.TargetPort.String() == "http" }) {
			if s.Spec.SessionAffinity != corev1.ServiceAffinityClientIP {
				t.Errorf("Service %s spreads one client's calls over the replicas (sessionAffinity %q): each follow-up on a replica without its pin reads it from Redis, or waits there for its placement", s.Name, s.Spec.SessionAffinity)
			}
			return
		}
	}
	t.Error("no Service targets the gateway's http port")
}

// kubeCount writes a replica count; unset is the API's default, 1.
func kubeCount(n *int32) string {
	if n == nil {
		return "unset (1)"
	}
	return strconv.Itoa(int(*n))
}

func (kit *kubeKit) docByName(t *testing.T, kind, name string) any {
	t.Helper()
	for _, d := range kit.docs {
		if d.kind == kind && d.name == name {
			return d.obj
		}
	}
	t.Fatalf("the kit has no %s/%s", kind, name)
	return nil
}

// TestKubeServicesSelectPodsAndNamedPorts: every Service selects the pods
// of one workload of the kit, and every port targets, by name, a port
// those pods' containers declare.
func TestKubeServicesSelectPodsAndNamedPorts(t *testing.T) {
	kit := kubeLoad(t)
	for _, s := range kit.services {
		var selected []kubeWorkload
		for _, w := range kit.workloads {
			if kubeSubset(s.Spec.Selector, w.pod.Labels) {
				selected = append(selected, w)
			}
		}
		if len(selected) != 1 {
			t.Errorf("Service %s (selector %v) selects %d workloads, want 1", s.Name, s.Spec.Selector, len(selected))
			continue
		}
		w := selected[0]
		if len(s.Spec.Ports) == 0 {
			t.Errorf("Service %s has no ports", s.Name)
		}
		for _, p := range s.Spec.Ports {
			if p.Protocol != "" && p.Protocol != corev1.ProtocolTCP {
				t.Errorf("Service %s port %s: protocol %s, every listener is TCP", s.Name, p.Name, p.Protocol)
			}
			target := p.TargetPort
			if target.Type != intstr.String {
				t.Errorf("Service %s port %s targets %s: name the container port, so that a renumbered port cannot be missed", s.Name, p.Name, target.String())
				continue
			}
			ok := false
			for _, c := range w.pod.Spec.Containers {
				for _, cp := range c.Ports {
					if cp.Name == target.StrVal {
						ok = true
					}
				}
			}
			if !ok {
				t.Errorf("Service %s port %s targets %s, which no container of %s declares", s.Name, p.Name, target.String(), w)
			}
		}
	}
}

// kubeRedisSet is the kit's Redis: the StatefulSet whose pods run the
// script's server and sentinel roles, the script, and the headless Service
// that names the pods.
type kubeRedisSet struct {
	w          kubeWorkload
	sts        *appsv1.StatefulSet
	server     *corev1.Container
	sentinel   *corev1.Container
	scriptPath string // where both containers read the script
	script     string // the script, from the kit's ConfigMap
	headless   *corev1.Service
}

// kubeScriptRole reads a container's command `sh SCRIPT ROLE`.
func kubeScriptRole(c *corev1.Container) (script, role string, ok bool) {
	if len(c.Command) == 3 && c.Command[0] == "sh" {
		return c.Command[1], c.Command[2], true
	}
	return "", "", false
}

// redisSet finds the kit's Redis set and fails the test unless there is
// exactly one, with a server and a sentinel container of the redis image
// that run the same script, read from a ConfigMap of the kit.
func (kit *kubeKit) redisSet(t *testing.T) kubeRedisSet {
	t.Helper()
	var found []kubeRedisSet
	for _, w := range kit.workloads {
		if w.kind != "StatefulSet" {
			continue
		}
		rs := kubeRedisSet{w: w, sts: kit.docByName(t, w.kind, w.name).(*appsv1.StatefulSet)}
		for i := range w.pod.Spec.Containers {
			c := &w.pod.Spec.Containers[i]
			script, role, ok := kubeScriptRole(c)
			if !ok || !strings.HasPrefix(path.Base(c.Image), "redis:") {
				continue
			}
			if rs.scriptPath != "" && script != rs.scriptPath {
				t.Fatalf("%s: its containers run two scripts, %s and %s", w, rs.scriptPath, script)
			}
			rs.scriptPath = script
			switch role {
			case "server":
				rs.server = c
			case "sentinel":
				rs.sentinel = c
			default:
				t.Fatalf("%s container %s: role %q, want server or sentinel", w, c.Name, role)
			}
		}
		if rs.server != nil || rs.sentinel != nil {
			found = append(found, rs)
		}
	}
	if len(found) != 1 || found[0].server == nil || found[0].sentinel == nil {
		t.Fatalf("want one StatefulSet whose pods run `sh SCRIPT server` and `sh SCRIPT sentinel` on the redis image, found %d", len(found))
	}
	rs := found[0]
	for _, c := range []*corev1.Container{rs.server, rs.sentinel} {
		script, err := kit.configMapFile(&rs.w.pod.Spec, c, rs.scriptPath)
		if err != nil {
			t.Fatalf("%s container %s: %v", rs.w, c.Name, err)
		}
		rs.script = script
	}
	for _, s := range kit.services {
		if s.Name == rs.sts.Spec.ServiceName {
			rs.headless = s
		}
	}
	if rs.headless == nil {
		t.Fatalf("%s: serviceName %q is no Service of the kit", rs.w, rs.sts.Spec.ServiceName)
	}
	return rs
}

// podNames are the set's pods' DNS names, pod.service, by ordinal.
func (rs kubeRedisSet) podNames() []string {
	n := 1
	if rs.sts.Spec.Replicas != nil {
		n = int(*rs.sts.Spec.Replicas)
	}
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s-%d.%s", rs.sts.Name, i, rs.sts.Spec.ServiceName)
	}
	return out
}

// kubeEnvRef matches what the kubelet expands in an env value: $$ (a
// literal $) and $(NAME).
var kubeEnvRef = regexp.MustCompile(`\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)

// kubeContainerEnv is the environment the kubelet gives container c of pod
// podName: $(NAME) in a value expanded from the variables before it,
// fieldRef metadata.name the pod's name. Any other source fails the test
// (a secretKeyRef too: TestKubeNoSecretInEnv).
func kubeContainerEnv(t *testing.T, c *corev1.Container, podName string) map[string]string {
	t.Helper()
	env := map[string]string{}
	for _, ev := range c.Env {
		switch {
		case ev.ValueFrom == nil:
			env[ev.Name] = kubeEnvRef.ReplaceAllStringFunc(ev.Value, func(ref string) string {
				if ref == "$$" {
					return "$"
				}
				if v, ok := env[ref[2:len(ref)-1]]; ok {
					return v
				}
				return ref // the kubelet leaves an undefined reference as it is
			})
		case ev.ValueFrom.FieldRef != nil && ev.ValueFrom.FieldRef.FieldPath == "metadata.name":
			env[ev.Name] = podName
		default:
			t.Fatalf("container %s: env %s comes from a source this test does not know", c.Name, ev.Name)
		}
	}
	return env
}

// kubeRedisPasswordEnv names the file redis.sh reads the password from.
const kubeRedisPasswordEnv = "REDIS_PASSWORD_FILE"

// secretFileEnv is the Secret key behind the file that env var name of
// container c names, after checking that the file is mounted as
// checkSecretFile wants it and that the Secret is not optional (an optional
// one starts Redis without its file when the key is missing).
func (kit *kubeKit) secretFileEnv(ps *corev1.PodSpec, c *corev1.Container, name string) (kubeSecretRef, error) {
	for _, ev := range c.Env {
		if ev.Name != name {
			continue
		}
		if ev.ValueFrom != nil || !path.IsAbs(ev.Value) {
			return kubeSecretRef{}, fmt.Errorf("env %s is not the path of a file", name)
		}
		ref, err := kit.checkSecretFile(ps, c, ev.Value)
		if err != nil {
			return kubeSecretRef{}, fmt.Errorf("env %s: %w", name, err)
		}
		f, _ := kubeResolve(ps, c, ev.Value)
		if o := f.volume.Secret.Optional; o != nil && *o {
			return kubeSecretRef{}, fmt.Errorf("env %s: volume %s's Secret is optional", name, f.volume.Name)
		}
		return ref, nil
	}
	return kubeSecretRef{}, fmt.Errorf("no env %s", name)
}

// kubeContainerPort is the one port container c declares.
func kubeContainerPort(t *testing.T, c *corev1.Container) corev1.ContainerPort {
	t.Helper()
	if len(c.Ports) != 1 {
		t.Fatalf("container %s declares %d ports, want 1", c.Name, len(c.Ports))
	}
	return c.Ports[0]
}

// serviceByHost is the Service of the kit a host name reaches from the
// kit's namespace, nil if none.
func (kit *kubeKit) serviceByHost(host string) *corev1.Service {
	name := strings.TrimSuffix(host, ".")
	for _, s := range kit.services {
		for _, n := range []string{s.Name, s.Name + "." + kit.namespace, s.Name + "." + kit.namespace + ".svc", s.Name + "." + kit.namespace + ".svc.cluster.local"} {
			if name == n {
				return s
			}
		}
	}
	return nil
}

// kubeGatewayContainer is the kit's gateway container with its config.
func (kit *kubeKit) gatewayContainer(t *testing.T) (kubeEncgateContainer, string) {
	t.Helper()
	for _, e := range kit.encgateContainers() {
		if !kubeRunsSubcommand(e.c) || e.c.Args[0] != "gateway" {
			continue
		}
		got, err := kubeParseArgs(e.c.Args[1:], map[string]bool{"config": true, "check": false})
		if err != nil || len(got["config"]) != 1 {
			t.Fatalf("%s: args %q: %v", e, e.c.Args, err)
		}
		content, err := kit.configMapFile(&e.w.pod.Spec, e.c, got["config"][0])
		if err != nil {
			t.Fatal(err)
		}
		return e, content
	}
	t.Fatal("no gateway container")
	return kubeEncgateContainer{}, ""
}

// TestKubeGatewayUsesTheKitsSentinels: the gateway config keeps its shared
// state in Redis through Sentinel: every sentinel_addrs entry is a port of a
// Service of the kit that reaches the sentinels of the kit's Redis set,
// master_name is the name they monitor, and the servers and sentinels
// require the password the gateway reads from password_file and
// sentinel_password_file, the same key of the same Secret. The set is
// three pods with stable names (a headless Service that publishes pods not
// yet ready, which the set's first start needs), which the script's SELF
// and NODES name, on the ports the containers declare; a
// PodDisruptionBudget lets one go at a time, so two sentinels keep the
// quorum.
func TestKubeGatewayUsesTheKitsSentinels(t *testing.T) {
	kit := kubeLoad(t)
	e, content := kit.gatewayContainer(t)
	orig, _ := kubeLoadConfig(t, "gateway", content) // the Secret's paths
	rc := orig.(gateway.Config).Redis
	var pw kubeSecretRef
	for field, file := range map[string]string{"redis.password_file": rc.PasswordFile, "redis.sentinel_password_file": rc.SentinelPasswordFile} {
		if file == "" {
			t.Fatalf("%s is not set: the kit's Redis servers and sentinels require a password", field)
		}
		ref, err := kit.checkSecretFile(&e.w.pod.Spec, e.c, file)
		if err != nil {
			t.Fatalf("%s: %v", field, err)
		}
		if pw.secret != "" && (ref.secret != pw.secret || ref.key != pw.key) {
			t.Errorf("%s is Secret %s key %s, the other password file Secret %s key %s: the sentinels require the servers' password", field, ref.secret, ref.key, pw.secret, pw.key)
		}
		pw = ref
	}
	_, loaded := kit.localConfig(t, e, content, nil)
	cfg := loaded.(gateway.Config)
	if cfg.Idempotency.Store != "redis" {
		t.Fatalf("idempotency.store %q: the replicas must share their state (redis)", cfg.Idempotency.Store)
	}
	if cfg.Redis.Mode != "sentinel" || len(cfg.Redis.SentinelAddrs) == 0 {
		t.Fatalf("redis.mode %q with sentinel_addrs %v: the kit's Redis is a Sentinel set", cfg.Redis.Mode, cfg.Redis.SentinelAddrs)
	}

	rs := kit.redisSet(t)
	if rs.sts.Spec.Replicas == nil || *rs.sts.Spec.Replicas != 3 {
		t.Errorf("%s: replicas %s, want 3 (a master, two replicas, three sentinels for a quorum of 2)", rs.w, kubeCount(rs.sts.Spec.Replicas))
	}
	serverPort, sentinelPort := kubeContainerPort(t, rs.server), kubeContainerPort(t, rs.sentinel)
	for _, c := range []*corev1.Container{rs.server, rs.sentinel} {
		ref, err := kit.secretFileEnv(&rs.w.pod.Spec, c, kubeRedisPasswordEnv)
		if err != nil {
			t.Errorf("%s container %s: %v", rs.w, c.Name, err)
		} else if ref.secret != pw.secret || ref.key != pw.key {
			t.Errorf("%s container %s requires the password of Secret %s key %s, the gateway reads Secret %s key %s", rs.w, c.Name, ref.secret, ref.key, pw.secret, pw.key)
		}
		names := rs.podNames()
		for i, pod := range names {
			env := kubeContainerEnv(t, c, fmt.Sprintf("%s-%d", rs.sts.Name, i))
			want := map[string]string{
				"SELF":          pod,
				"NODES":         strings.Join(names, " "),
				"MASTER_NAME":   cfg.Redis.MasterName,
				"REDIS_PORT":    strconv.Itoa(int(serverPort.ContainerPort)),
				"SENTINEL_PORT": strconv.Itoa(int(sentinelPort.ContainerPort)),
			}
			for k, v := range want {
				if env[k] != v {
					t.Errorf("%s container %s, pod %d: %s is %q, want %q", rs.w, c.Name, i, k, env[k], v)
				}
			}
			if _, ok := env["BIND"]; ok {
				t.Errorf("%s container %s sets BIND: the pods listen on every interface", rs.w, c.Name)
			}
		}
	}
	if h := rs.headless; h.Spec.ClusterIP != corev1.ClusterIPNone || !h.Spec.PublishNotReadyAddresses || !kubeSubset(h.Spec.Selector, rs.w.pod.Labels) {
		t.Errorf("Service %s (the StatefulSet's serviceName): clusterIP %q, publishNotReadyAddresses %v, selector %v: want a headless Service of the set's pods that publishes them before they are ready",
			h.Name, h.Spec.ClusterIP, h.Spec.PublishNotReadyAddresses, h.Spec.Selector)
	}

	for i, addr := range cfg.Redis.SentinelAddrs {
		host, port := kubePort(t, addr)
		svc := kit.serviceByHost(host)
		if svc == nil {
			t.Errorf("redis.sentinel_addrs[%d] %s names no Service of the kit (in namespace %s)", i, addr, kit.namespace)
			continue
		}
		if !kubeSubset(svc.Spec.Selector, rs.w.pod.Labels) {
			t.Errorf("redis.sentinel_addrs[%d] %s: Service %s does not select %s's pods", i, addr, svc.Name, rs.w)
		}
		j := slices.IndexFunc(svc.Spec.Ports, func(p corev1.ServicePort) bool { return p.Port == port })
		if j < 0 {
			t.Errorf("redis.sentinel_addrs[%d] %s: Service %s has no port %d", i, addr, svc.Name, port)
		} else if tp := svc.Spec.Ports[j].TargetPort.String(); tp != sentinelPort.Name && tp != strconv.Itoa(int(sentinelPort.ContainerPort)) {
			t.Errorf("redis.sentinel_addrs[%d] %s: Service %s port %d targets %s, not the sentinel container's port %s", i, addr, svc.Name, port, tp, sentinelPort.Name)
		}
	}

	pdbs := 0
	for _, pdb := range kit.pdbs {
		if !kubeSelects(t, pdb.Spec.Selector, rs.w.pod.Labels) {
			continue
		}
		pdbs++
		mu, ma := pdb.Spec.MaxUnavailable, pdb.Spec.MinAvailable
		switch {
		case mu != nil && ma == nil && mu.Type == intstr.Int && mu.IntVal == 1:
		case ma != nil && mu == nil && ma.Type == intstr.Int && rs.sts.Spec.Replicas != nil && ma.IntVal == *rs.sts.Spec.Replicas-1:
		default:
			t.Errorf("PodDisruptionBudget %s: maxUnavailable %v, minAvailable %v: want one pod of the set down at a time", pdb.Name, mu, ma)
		}
	}
	if pdbs != 1 {
		t.Errorf("%d PodDisruptionBudgets select %s's pods, want 1", pdbs, rs.w)
	}
}

// kubeKeyPaths lists the dotted key paths of a YAML document's mappings
// (lists are not entered: their entries are examples).
func kubeKeyPaths(t *testing.T, src string) map[string]bool {
	t.Helper()
	var doc yaml.Node
	if err := yaml.Unmarshal([]byte(src), &doc); err != nil {
		t.Fatal(err)
	}
	out := map[string]bool{}
	var walk func(prefix string, n *yaml.Node)
	walk = func(prefix string, n *yaml.Node) {
		if n.Kind != yaml.MappingNode {
			return
		}
		for i := 0; i+1 < len(n.Content); i += 2 {
			p := prefix + n.Content[i].Value
			out[p] = true
			walk(p+".", n.Content[i+1])
		}
	}
	if len(doc.Content) > 0 {
		walk("", doc.Content[0])
	}
	return out
}

// TestKubeConfigsAreComplete: the ConfigMaps' configs write every key the
// example configs (configs/*.yaml, which show every key) have, so that an
// operator reads each setting in force where it is set.
func TestKubeConfigsAreComplete(t *testing.T) {
	kit := kubeLoad(t)
	checked := 0
	for _, e := range kit.encgateContainers() {
		if !kubeRunsSubcommand(e.c) {
			continue
		}
		sub := e.c.Args[0]
		got, err := kubeParseArgs(e.c.Args[1:], map[string]bool{"config": true, "check": false})
		if err != nil || len(got["config"]) != 1 {
			t.Fatalf("%s: args %q: %v", e, e.c.Args, err)
		}
		content, err := kit.configMapFile(&e.w.pod.Spec, e.c, got["config"][0])
		if err != nil {
			t.Fatal(err)
		}
		example, err := os.ReadFile(filepath.Join(kubeModuleRoot, "configs", sub+".yaml"))
		if err != nil {
			t.Fatal(err)
		}
		have := kubeKeyPaths(t, content)
		for k := range kubeKeyPaths(t, string(example)) {
			if !have[k] {
				t.Errorf("%s: the config leaves out %s (configs/%s.yaml has it)", e, k, sub)
			}
		}
		checked++
	}
	if checked != 2 {
		t.Errorf("checked %d configs, want the gateway's and the agent's", checked)
	}
}

// TestKubeSecretPlaceholdersAreRefused: no placeholder of the kit's
// Secrets is a value the binary accepts, so the kit applied unchanged never
// runs with a secret that is published here. Each secret file a config
// reads is loaded with its Secret's value as it is (written to a file of
// mode 0600), the others with valid test values: the load fails, naming
// that file's field, without quoting the value.
func TestKubeSecretPlaceholdersAreRefused(t *testing.T) {
	kit := kubeLoad(t)
	checked := map[string]int{}
	for _, e := range kit.encgateContainers() {
		if !kubeRunsSubcommand(e.c) {
			continue
		}
		sub := e.c.Args[0]
		got, _ := kubeParseArgs(e.c.Args[1:], map[string]bool{"config": true, "check": false})
		content, err := kit.configMapFile(&e.w.pod.Spec, e.c, got["config"][0])
		if err != nil {
			t.Fatal(err)
		}
		first, _ := kubeLoadConfig(t, sub, content)
		files := kubeSecretFiles(sub, first)
		valid := map[string]string{}
		for yp := range files {
			valid[yp] = secretfiletest.Write(t, "secret", kubeTestToken+"\n", 0o600)
		}
		for yp, file := range files {
			ref, err := kit.checkSecretFile(&e.w.pod.Spec, e.c, file)
			if err != nil {
				t.Fatalf("%s: %s: %v", e, yp, err)
			}
			sets := maps.Clone(valid)
			sets[yp] = secretfiletest.Write(t, "secret", ref.value, 0o600)
			_, err = kubeLoadConfig(t, sub, kubeSetYAML(t, content, sets))
			if field := kubeFieldPath(yp); err == nil || !strings.Contains(err.Error(), field+": ") {
				t.Errorf("%s accepts the placeholder of Secret %s key %s as its %s: %v", sub, ref.secret, ref.key, field, err)
			}
			if ref.value != "" && strings.Contains(fmt.Sprint(err), ref.value) {
				t.Errorf("%s's error quotes the placeholder: %v", sub, err)
			}
			checked[sub+" "+yp]++
		}
	}
	for _, want := range []string{"agent control.token_file", "gateway admin.token_file", "gateway bootstrap.token_file", "gateway redis.password_file", "gateway redis.sentinel_password_file"} {
		if checked[want] == 0 {
			t.Errorf("no Secret placeholder checked for the %s: the config reads no such file", want)
		}
	}
}

// kubeProcess is a running encgate with its JSON log lines.
type kubeProcess struct {
	cmd   *exec.Cmd
	lines chan map[string]any
	log   *bytes.Buffer // every line, for failure messages
	done  chan struct{} // closed when stderr ends
}

func kubeStart(t *testing.T, bin string, args []string) *kubeProcess {
	t.Helper()
	cmd := exec.Command(bin, args...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	p := &kubeProcess{cmd: cmd, lines: make(chan map[string]any, 1024), log: new(bytes.Buffer), done: make(chan struct{})}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		defer close(p.done)
		defer close(p.lines)
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			p.log.WriteString(sc.Text() + "\n")
			var m map[string]any
			if json.Unmarshal(sc.Bytes(), &m) == nil {
				select {
				case p.lines <- m:
				default: // nobody waits for that many lines
				}
			}
		}
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-p.done
		_ = cmd.Wait()
	})
	return p
}

// waitFor returns the first log line whose msg is msg; it fails the test
// when the process ends first, or after a minute.
func (p *kubeProcess) waitFor(t *testing.T, msg string) map[string]any {
	t.Helper()
	timeout := time.NewTimer(time.Minute)
	defer timeout.Stop()
	for {
		select {
		case m, ok := <-p.lines:
			if !ok {
				t.Fatalf("encgate ended before logging %q:\n%s", msg, p.logText())
			}
			if m["msg"] == msg {
				return m
			}
		case <-timeout.C:
			t.Fatalf("no %q log line within a minute", msg)
		}
	}
}

func (p *kubeProcess) logText() string {
	<-p.done
	return p.log.String()
}

// kubePosted is an answer to kubePost.
type kubePosted struct {
	status   int
	body     string
	replayed bool // X-Encgate-Replayed: true
}

func kubePost(t *testing.T, url, body string) kubePosted {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	return kubePosted{resp.StatusCode, string(b), resp.Header.Get("X-Encgate-Replayed") == "true"}
}

func kubeGet(t *testing.T, url, token string) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode
}

// TestKubeProbesAnswerOnTheRealProcesses runs each encgate container's
// args on its ConfigMap's config (addresses moved to loopback, secret files
// to the test's own, and the gateway's sentinel_addrs to a Sentinel set
// whose servers and sentinels require the password) and asks each of its
// probe paths where the probe points: 200. The gateway dedupes a /send
// through the master the sentinels name. The gateway's drain is what the
// probes are sized for: after SIGTERM /readyz fails while /healthz passes
// and the listener still accepts.
func TestKubeProbesAnswerOnTheRealProcesses(t *testing.T) {
	kit := kubeLoad(t)
	bin := kubeBuild(t)
	for _, e := range kit.encgateContainers() {
		if !kubeRunsSubcommand(e.c) {
			continue
		}
		sub := e.c.Args[0]
		t.Run(sub, func(t *testing.T) {
			got, err := kubeParseArgs(e.c.Args[1:], map[string]bool{"config": true, "check": false})
			if err != nil || len(got["config"]) != 1 {
				t.Fatalf("%s: args %q: %v", e, e.c.Args, err)
			}
			content, err := kit.configMapFile(&e.w.pod.Spec, e.c, got["config"][0])
			if err != nil {
				t.Fatal(err)
			}
			sets := map[string]string{"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0"}
			var sockDir string
			var sn *redistest.Sentinel
			var enc *fakeencoder.Encoder
			switch sub {
			case "gateway":
				sets["bootstrap.listen"] = "127.0.0.1:0"
				// The kit's Redis servers and sentinels require the
				// password the gateway reads from password_file and
				// sentinel_password_file: kubeTestToken here. The
				// sentinels' loopback addresses stand for the kit's
				// Service, and a fake encoder for the fleet.
				sn = redistest.StartSentinel(t, redistest.WithPassword(kubeTestToken), redistest.WithSentinelPassword(kubeTestToken))
				sets["redis.master_name"] = sn.MasterName()
				enc = fakeencoder.New(fakeencoder.Options{Name: "enc-a", Mode: fakeencoder.ModeMooncake})
				if err := enc.Start("127.0.0.1:0"); err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = enc.Close() })
				// The test's callers are on loopback, outside the kit's
				// pod CIDR.
				content = kubeSetYAMLNodes(t, content, map[string]*yaml.Node{
					"redis.sentinel_addrs":     kubeYAMLJSON(t, sn.SentinelAddrs()),
					"encoders":                 kubeYAMLJSON(t, []map[string]string{{"name": "enc-a", "url": enc.URL()}}),
					"bootstrap.allow_networks": kubeYAMLJSON(t, []string{"127.0.0.0/8"}),
				})
			case "agent":
				// Short: a Unix socket path has 107 bytes at most.
				sockDir, err = os.MkdirTemp("", "kube")
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { os.RemoveAll(sockDir) })
				sets["control.socket"] = filepath.Join(sockDir, "agent.sock")
			}
			local, cfg := kit.localConfig(t, e, content, sets)
			if sub == "gateway" {
				if _, err := gateway.Descriptors(cfg.(gateway.Config), nil, false); err != nil {
					t.Skipf("the config cannot start on this machine: %v", err)
				}
			}
			p := filepath.Join(t.TempDir(), sub+".yaml")
			if err := os.WriteFile(p, []byte(local), 0o600); err != nil {
				t.Fatal(err)
			}
			args := slices.Clone(e.c.Args)
			args[slices.Index(args, got["config"][0])] = p
			proc := kubeStart(t, bin, args)
			var boot map[string]any
			if sub == "gateway" {
				boot = proc.waitFor(t, "bootstrap listening") // logged before "gateway listening"
			}
			ready := proc.waitFor(t, sub+" listening")
			admin, _ := ready["admin_listen"].(string)
			listen, _ := ready["listen"].(string)
			if admin == "" || listen == "" {
				t.Fatalf("the %q line names no addresses: %v", sub+" listening", ready)
			}
			paths := []string{}
			for _, pr := range []*corev1.Probe{e.c.ReadinessProbe, e.c.LivenessProbe, e.c.StartupProbe} {
				if pr != nil && pr.HTTPGet != nil {
					paths = append(paths, pr.HTTPGet.Path)
				}
			}
			if a := e.w.pod.Annotations["prometheus.io/path"]; a != "" {
				paths = append(paths, a)
			}
			if len(paths) < 2 {
				t.Fatalf("%s has %d httpGet probes", e, len(paths))
			}
			for _, pth := range paths {
				if code := kubeGet(t, "http://"+admin+pth, ""); code != http.StatusOK {
					t.Errorf("GET %s on admin_listen: %d, want 200", pth, code)
				}
			}
			switch sub {
			case "agent":
				// The TCP door took the token file: 401 without it, not with it.
				if code := kubeGet(t, "http://"+listen+"/v1/receiver", ""); code != http.StatusUnauthorized {
					t.Errorf("GET /v1/receiver without the token: %d, want 401", code)
				}
				if code := kubeGet(t, "http://"+listen+"/v1/receiver", kubeTestToken); code == http.StatusUnauthorized {
					t.Errorf("GET /v1/receiver with the token: 401")
				}
				if fi, err := os.Lstat(sets["control.socket"]); err != nil || fi.Mode()&fs.ModeSocket == 0 {
					t.Errorf("no control socket at %s: %v", sets["control.socket"], err)
				}
				if err := proc.cmd.Process.Signal(syscall.SIGTERM); err != nil {
					t.Fatal(err)
				}
				<-proc.done
				if err := proc.cmd.Wait(); err != nil {
					t.Errorf("the agent did not drain cleanly on SIGTERM: %v\n%s", err, proc.logText())
				}
			case "gateway":
				// bootstrap.token_file's token (the Secret's bootstrap-token)
				// is the path the bootstrap API is served under.
				bootAddr, _ := boot["bootstrap_listen"].(string)
				if code := kubeGet(t, "http://"+bootAddr+"/health", ""); code != http.StatusNotFound {
					t.Errorf("GET /health on the bootstrap listener without the token: %d, want 404", code)
				}
				if code := kubeGet(t, "http://"+bootAddr+"/t/"+kubeTestToken+"/health", ""); code != http.StatusOK {
					t.Errorf("GET /t/<token>/health on the bootstrap listener: %d, want 200", code)
				}
				// A /send reaches the encoder once through the master the
				// sentinels name: the record the first one wrote there is
				// what its duplicate replays.
				const id = "kube_local_part_0"
				if r := kubePost(t, "http://"+listen+"/encode", fmt.Sprintf(`{"req_id":%q,"mm_items":["x"],"modality":"IMAGE","num_parts":1,"part_idx":0,"prefill_host":"10.0.0.1","embedding_port":null}`, id)); r.status != http.StatusOK {
					t.Fatalf("/encode: %+v", r)
				}
				send := fmt.Sprintf(`{"req_id":%q,"part_idx":0,"prefill_host":"10.0.0.1","embedding_port":40000,"session_id":"10.0.0.1:17000","buffer_address":4096,"receive_count":1}`, id)
				first, again := kubePost(t, "http://"+listen+"/send", send), kubePost(t, "http://"+listen+"/send", send)
				if first.status != http.StatusOK || first.replayed || again.status != http.StatusOK || !again.replayed || again.body != first.body {
					t.Errorf("a /send and its duplicate through Sentinel: first %+v, again %+v; want 200, then 200 replayed", first, again)
				}
				if n := enc.Stats().Sends[id+"|10.0.0.1:40000"]; n != 1 {
					t.Errorf("the encoder received the /send %d times, want 1", n)
				}
				master := goredis.NewClient(&goredis.Options{Addr: sn.MasterAddr(), Password: kubeTestToken})
				defer master.Close()
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				keys, err := master.Keys(ctx, cfg.(gateway.Config).Redis.KeyPrefix+"{"+id+"}*").Result()
				cancel()
				if err != nil || len(keys) == 0 {
					t.Errorf("the master the sentinels name holds no key of %s: %v, %v", id, keys, err)
				}
				// admin.token_file's token guards /admin/...; with it, the
				// /send record is read from Redis, which took the password
				// of password_file (a refused AUTH is a 503 here).
				sends := "http://" + admin + "/admin/sends/" + id
				if code := kubeGet(t, sends, ""); code != http.StatusUnauthorized {
					t.Errorf("GET /admin/sends without the admin token: %d, want 401", code)
				}
				if code := kubeGet(t, sends, kubeTestToken); code != http.StatusOK {
					t.Errorf("GET /admin/sends with the admin token: %d, want 200 (from Redis, authenticated)", code)
				}
				if err := proc.cmd.Process.Signal(syscall.SIGTERM); err != nil {
					t.Fatal(err)
				}
				// Logged once /readyz answers 503; the listener stays open for
				// shutdown.delay after it (15s: far longer than these checks).
				proc.waitFor(t, "draining: not ready")
				if code := kubeGet(t, "http://"+admin+e.c.ReadinessProbe.HTTPGet.Path, ""); code != http.StatusServiceUnavailable {
					t.Errorf("readiness probe while draining: %d, want 503", code)
				}
				if code := kubeGet(t, "http://"+admin+e.c.LivenessProbe.HTTPGet.Path, ""); code != http.StatusOK {
					t.Errorf("liveness probe while draining: %d, want 200 (or the kubelet restarts a draining gateway)", code)
				}
				conn, err := net.DialTimeout("tcp", listen, 5*time.Second)
				if err != nil {
					t.Errorf("the listener refused a connection within shutdown.delay: %v", err)
				} else {
					conn.Close()
				}
			}
		})
	}
}

// TestKubeKustomizeBuild renders the kit with kubectl's kustomize (when
// kubectl is installed): it builds, everything lands in the
// kustomization's namespace, and the rendered objects are the manifests'.
func TestKubeKustomizeBuild(t *testing.T) {
	kubectl, err := exec.LookPath("kubectl")
	if err != nil {
		t.Skip("kubectl is not installed") // optional: not a test dependency .ci/run installs, so not testtool.Need
	}
	kit := kubeLoad(t)
	var stderr bytes.Buffer
	cmd := exec.Command(kubectl, "kustomize", kubeDir)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("kubectl kustomize %s: %v\n%s", kubeDir, err, stderr.String())
	}
	docs, err := kubeDecodeStream("kustomize output", out)
	if err != nil {
		t.Fatal(err)
	}
	var rendered, raw []string
	for _, d := range docs {
		rendered = append(rendered, d.kind+"/"+d.name)
		if d.kind != "Namespace" && d.ns != kit.namespace {
			t.Errorf("%s/%s rendered in namespace %q, want %q", d.kind, d.name, d.ns, kit.namespace)
		}
	}
	for _, d := range kit.docs {
		raw = append(raw, d.kind+"/"+d.name)
	}
	slices.Sort(rendered)
	slices.Sort(raw)
	if !slices.Equal(rendered, raw) {
		t.Errorf("kustomize renders %v, the manifests hold %v", rendered, raw)
	}
}

// kubeRedisRun runs the kit's Redis set on this machine as the StatefulSet
// runs it: the script from the ConfigMap, each container's command, args
// and environment (as the kubelet computes it), each pod on a loopback
// address of its own, which stands for its DNS name.
type kubeRedisRun struct {
	t        *testing.T
	rs       kubeRedisSet
	script   string   // the script's file here
	password string   // the password file here, holding kubeTestToken
	home     string   // HOME for every process
	ips      []string // pod i's address
	names    []string // pod i's DNS name in the kit
	redisP   int
	sentP    int
	pods     []*kubeRedisPod
	running  map[*exec.Cmd]chan struct{} // closed when the process ends
	clients  map[string]*goredis.Client
}

// kubeRedisPod is one pod: its emptyDirs (kept across its containers'
// restarts) and its containers' processes.
type kubeRedisPod struct {
	dirs             map[string]string // container name: its working directory
	server, sentinel *exec.Cmd
}

// kubeLoopbackPorts finds two ports free on every address of ips.
func kubeLoopbackPorts(t *testing.T, ips []string) (int, int) {
	t.Helper()
	var ports []int
	for try := 0; len(ports) < 2 && try < 50; try++ {
		l, err := net.Listen("tcp", net.JoinHostPort(ips[0], "0"))
		if err != nil {
			t.Skipf("cannot listen on %s (this test gives each pod a loopback address of its own): %v", ips[0], err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		free := !slices.Contains(ports, port)
		var held []net.Listener
		for _, ip := range ips[1:] {
			m, err := net.Listen("tcp", net.JoinHostPort(ip, strconv.Itoa(port)))
			if err != nil {
				free = false
				break
			}
			held = append(held, m)
		}
		l.Close()
		for _, m := range held {
			m.Close()
		}
		if free {
			ports = append(ports, port)
		}
	}
	if len(ports) < 2 {
		t.Fatalf("no two ports free on all of %v", ips)
	}
	return ports[0], ports[1]
}

func newKubeRedisRun(t *testing.T, rs kubeRedisSet) *kubeRedisRun {
	t.Helper()
	for _, need := range [][2]string{{"sh", "dash"}, {"timeout", "coreutils"}, {redistest.Binary, "redis-server"},
		{redistest.SentinelBinary, "redis-sentinel"}, {"redis-cli", "redis-tools"}} {
		testtool.Need(t, need[0], need[1])
	}
	r := &kubeRedisRun{t: t, rs: rs, names: rs.podNames(), running: map[*exec.Cmd]chan struct{}{}, clients: map[string]*goredis.Client{}}
	for i := range r.names {
		r.ips = append(r.ips, fmt.Sprintf("127.0.0.%d", i+2))
	}
	r.redisP, r.sentP = kubeLoopbackPorts(t, r.ips)
	r.home = t.TempDir()
	r.password = secretfiletest.Write(t, "redis-password", kubeTestToken+"\n", 0o600)
	r.script = filepath.Join(t.TempDir(), "redis.sh")
	if err := os.WriteFile(r.script, []byte(rs.script), 0o600); err != nil {
		t.Fatal(err)
	}
	r.pods = make([]*kubeRedisPod, len(r.names))
	t.Cleanup(func() {
		for cmd, done := range r.running {
			_ = cmd.Process.Kill()
			<-done
		}
	})
	return r
}

// env is container c's environment in pod i, moved to this machine: the
// pods' DNS names in SELF and NODES become their addresses, the ports the
// test's, BIND the pod's address, and a path of a file the pod's Secret
// volume provides (the password file) the test's password file.
func (r *kubeRedisRun) env(i int, c *corev1.Container) []string {
	t := r.t
	env := kubeContainerEnv(t, c, fmt.Sprintf("%s-%d", r.rs.sts.Name, i))
	addr := func(name string) string {
		j := slices.Index(r.names, name)
		if j < 0 {
			t.Fatalf("container %s names %q, which is none of the pods %v", c.Name, name, r.names)
		}
		return r.ips[j]
	}
	var nodes []string
	for n := range strings.FieldsSeq(env["NODES"]) {
		nodes = append(nodes, addr(n))
	}
	env["SELF"] = addr(env["SELF"])
	env["NODES"] = strings.Join(nodes, " ")
	env["REDIS_PORT"], env["SENTINEL_PORT"] = strconv.Itoa(r.redisP), strconv.Itoa(r.sentP)
	env["BIND"] = r.ips[i]
	for k, v := range env {
		if f, err := kubeResolve(&r.rs.w.pod.Spec, c, v); err == nil && f.volume.Secret != nil {
			env[k] = r.password
		}
	}
	out := []string{"PATH=" + os.Getenv("PATH"), "HOME=" + r.home}
	for k, v := range env {
		out = append(out, k+"="+v)
	}
	return out
}

// command is an exec command of the manifest with the script's path
// moved to this machine's copy.
func (r *kubeRedisRun) command(argv []string) []string {
	out := slices.Clone(argv)
	for j, a := range out {
		if a == r.rs.scriptPath {
			out[j] = r.script
		}
	}
	return out
}

// startContainer starts container c of pod i (a first start or the
// kubelet's restart: the pod's emptyDir stays), its output in a log file.
func (r *kubeRedisRun) startContainer(i int, c *corev1.Container) *exec.Cmd {
	t := r.t
	p := r.pods[i]
	argv := append(r.command(c.Command), c.Args...)
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = r.env(i, c)
	cmd.Dir = p.dirs[c.Name]
	log, err := os.OpenFile(filepath.Join(cmd.Dir, "..", c.Name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer log.Close()
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	r.running[cmd] = done
	go func() { _ = cmd.Wait(); close(done) }()
	return cmd
}

// startPod creates pod i afresh (new emptyDirs) and starts its containers.
func (r *kubeRedisRun) startPod(i int) {
	dir := r.t.TempDir()
	p := &kubeRedisPod{dirs: map[string]string{}}
	for _, c := range []*corev1.Container{r.rs.server, r.rs.sentinel} {
		p.dirs[c.Name] = filepath.Join(dir, c.Name)
		if err := os.Mkdir(p.dirs[c.Name], 0o700); err != nil {
			r.t.Fatal(err)
		}
	}
	r.pods[i] = p
	p.server = r.startContainer(i, r.rs.server)
	p.sentinel = r.startContainer(i, r.rs.sentinel)
}

// kill ends a container's process as a crash would.
func (r *kubeRedisRun) kill(cmd *exec.Cmd) {
	_ = cmd.Process.Kill()
	<-r.running[cmd]
	delete(r.running, cmd)
}

// ready runs both containers' readiness probes, as the kubelet would.
func (r *kubeRedisRun) ready(i int) error {
	for _, c := range []*corev1.Container{r.rs.server, r.rs.sentinel} {
		if c.ReadinessProbe == nil || c.ReadinessProbe.Exec == nil {
			r.t.Fatalf("container %s has no exec readinessProbe", c.Name)
		}
		argv := r.command(c.ReadinessProbe.Exec.Command)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
		cmd.Env = r.env(i, c)
		out, err := cmd.CombinedOutput()
		cancel()
		if err != nil {
			return fmt.Errorf("pod %d container %s: readiness probe: %v %s", i, c.Name, err, out)
		}
	}
	return nil
}

// logs is every container's log, for failure messages.
func (r *kubeRedisRun) logs() string {
	var b strings.Builder
	for i, p := range r.pods {
		if p == nil {
			continue
		}
		for _, c := range []*corev1.Container{r.rs.server, r.rs.sentinel} {
			data, _ := os.ReadFile(filepath.Join(p.dirs[c.Name], "..", c.Name+".log"))
			if len(data) > 4000 {
				data = data[len(data)-4000:]
			}
			fmt.Fprintf(&b, "--- pod %d (%s) %s:\n%s\n", i, r.ips[i], c.Name, data)
		}
	}
	return b.String()
}

// eventually polls f (the processes give no signal to wait on) until it
// returns nil; the test fails with the logs after two minutes.
func (r *kubeRedisRun) eventually(what string, f func() error) {
	r.t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		err := f()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			r.t.Fatalf("%s: still not so after two minutes: %v\n%s", what, err, r.logs())
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// client is a client of pod i's server or sentinel (one per address: it
// reconnects to the same address after a restart).
func (r *kubeRedisRun) client(i, port int) *goredis.Client {
	addr := net.JoinHostPort(r.ips[i], strconv.Itoa(port))
	if c, ok := r.clients[addr]; ok {
		return c
	}
	// RESP2: SENTINEL MASTER and REPLICAS answer flat field/value lists.
	c := goredis.NewClient(&goredis.Options{Addr: addr, Password: kubeTestToken, Protocol: 2,
		DialTimeout: time.Second, ReadTimeout: time.Second, WriteTimeout: time.Second, MaxRetries: -1})
	r.clients[addr] = c
	r.t.Cleanup(func() { _ = c.Close() })
	return c
}

// settled is nil once the pods up are one set with pod master its master:
// every sentinel of them names it and sees the other servers as its
// replicas and the other sentinels, with quorum 2; every other server
// replicates it, its link up.
func (r *kubeRedisRun) settled(master string, up []int, masterName string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, i := range up {
		sn := r.client(i, r.sentP)
		m, err := sn.Do(ctx, "SENTINEL", "MASTER", masterName).Slice()
		if err != nil {
			return fmt.Errorf("sentinel %d: %w", i, err)
		}
		f := map[string]string{}
		for j := 0; j+1 < len(m); j += 2 {
			f[fmt.Sprint(m[j])] = fmt.Sprint(m[j+1])
		}
		want := map[string]string{"ip": master, "port": strconv.Itoa(r.redisP), "flags": "master", "quorum": "2",
			"num-other-sentinels": strconv.Itoa(len(r.ips) - 1)}
		for k, v := range want {
			if f[k] != v {
				return fmt.Errorf("sentinel %d: SENTINEL MASTER %s: %s is %q, want %q", i, masterName, k, f[k], v)
			}
		}
		reps, err := sn.Do(ctx, "SENTINEL", "REPLICAS", masterName).Slice()
		if err != nil {
			return fmt.Errorf("sentinel %d: %w", i, err)
		}
		ok := 0
		for _, rep := range reps {
			fields, _ := rep.([]any)
			g := map[string]string{}
			for j := 0; j+1 < len(fields); j += 2 {
				g[fmt.Sprint(fields[j])] = fmt.Sprint(fields[j+1])
			}
			if g["flags"] == "slave" && g["master-link-status"] == "ok" && g["master-host"] == master {
				ok++
			}
		}
		if ok != len(up)-1 {
			return fmt.Errorf("sentinel %d sees %d replicas of %s in sync, want %d", i, ok, master, len(up)-1)
		}
	}
	for _, i := range up {
		info, err := r.client(i, r.redisP).Info(ctx, "replication").Result()
		if err != nil {
			return fmt.Errorf("server %d: %w", i, err)
		}
		want := []string{"role:slave", "master_host:" + master, "master_link_status:up"}
		if r.ips[i] == master {
			want = []string{"role:master", fmt.Sprintf("connected_slaves:%d", len(up)-1)}
		}
		for _, w := range want {
			if !slices.Contains(strings.Split(strings.ReplaceAll(info, "\r", ""), "\n"), w) {
				return fmt.Errorf("server %d: INFO replication has no %s:\n%s", i, w, info)
			}
		}
	}
	return nil
}

// TestKubeRedisSetSurvivesItsMasterFailing runs the kit's Redis set as the
// StatefulSet runs it (kubeRedisRun): the pods start in order, each once
// the one before passes its readiness probes, and settle as one set, pod 0
// the master. The gateway's own Redis client, built from the kit's gateway
// config (sentinel_addrs moved to the pods' addresses), writes through it
// and follows, with no change, every failover below; nothing written
// before one, and replicated, is lost:
//   - the master's server crashes and the kubelet restarts it at once: the
//     sentinels still name it, so the script has them fail over and starts
//     it as a replica, never as an empty master its replicas would copy;
//   - the new master's pod goes away and stays away: the two sentinels left
//     (quorum 2, authenticating to each other) fail over by themselves;
//     the pod comes back as a replica.
func TestKubeRedisSetSurvivesItsMasterFailing(t *testing.T) {
	if testing.Short() {
		t.Skip("runs three Redis servers and three sentinels through the kit's script")
	}
	kit := kubeLoad(t)
	rs := kit.redisSet(t)
	r := newKubeRedisRun(t, rs)
	e, content := kit.gatewayContainer(t)
	var sentinels []string
	for _, ip := range r.ips {
		sentinels = append(sentinels, net.JoinHostPort(ip, strconv.Itoa(r.sentP)))
	}
	content = kubeSetYAMLNodes(t, content, map[string]*yaml.Node{"redis.sentinel_addrs": kubeYAMLJSON(t, sentinels)})
	_, loaded := kit.localConfig(t, e, content, nil)
	rc := loaded.(gateway.Config).Redis
	all := []int{0, 1, 2}
	if len(r.ips) != len(all) {
		t.Fatalf("the set has %d pods, this test runs 3", len(r.ips))
	}

	for i := range r.ips {
		r.startPod(i)
		r.eventually(fmt.Sprintf("pod %d ready", i), func() error { return r.ready(i) })
	}
	r.eventually("the set settled, pod 0 the master", func() error { return r.settled(r.ips[0], all, rc.MasterName) })

	gw, err := redisclient.New(rc)
	if err != nil {
		t.Fatal(err)
	}
	defer gw.Close()
	written := map[string]string{}
	// write sets key through the gateway's client, and waits until the
	// replicas up hold it: the set keeps what its replicas hold
	// (replication is asynchronous).
	write := func(key string, replicas int) {
		t.Helper()
		r.eventually("the gateway's client writes "+key, func() error {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			if err := gw.Set(ctx, key, key+"-value", 0).Err(); err != nil {
				return err
			}
			if n, err := gw.Do(ctx, "WAIT", replicas, 5000).Int(); err != nil || n != replicas {
				return fmt.Errorf("WAIT %d: %d replicas, %v", replicas, n, err)
			}
			return nil
		})
		written[key] = key + "-value"
	}
	readAll := func(what string) {
		t.Helper()
		r.eventually(what, func() error {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			for k, v := range written {
				if got, err := gw.Get(ctx, k).Result(); err != nil || got != v {
					return fmt.Errorf("GET %s: %q, %v", k, got, err)
				}
			}
			return nil
		})
	}
	masterNow := func() int {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		for _, i := range all {
			if role, err := r.client(i, r.redisP).Do(ctx, "ROLE").Slice(); err == nil && len(role) > 0 && role[0] == "master" {
				return i
			}
		}
		t.Fatalf("no server is the master\n%s", r.logs())
		return -1
	}
	write("kube:first", 2)

	// The master's server crashes; the kubelet restarts it at once.
	r.kill(r.pods[0].server)
	r.pods[0].server = r.startContainer(0, rs.server)
	var promoted int
	r.eventually("a replica promoted, pod 0 back as its replica", func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		addr, err := r.client(1, r.sentP).Do(ctx, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", rc.MasterName).StringSlice()
		if err != nil || len(addr) != 2 || addr[0] == r.ips[0] {
			return fmt.Errorf("the sentinels name %v (%v)", addr, err)
		}
		promoted = slices.Index(r.ips, addr[0])
		return r.settled(addr[0], all, rc.MasterName)
	})
	readAll("the gateway's client reads what it wrote before the crash")
	if got, err := r.client(0, r.redisP).Get(context.Background(), "kube:first").Result(); err != nil || got != written["kube:first"] {
		t.Errorf("pod 0, back as a replica, holds kube:first %q (%v): it did not copy the new master", got, err)
	}
	write("kube:second", 2)

	// The new master's pod goes away: server and sentinel, for good.
	gone := masterNow()
	if gone != promoted {
		t.Fatalf("pod %d is the master, the sentinels named pod %d", gone, promoted)
	}
	r.kill(r.pods[gone].server)
	r.kill(r.pods[gone].sentinel)
	left := slices.DeleteFunc(slices.Clone(all), func(i int) bool { return i == gone })
	r.eventually("the two sentinels left fail over", func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		for _, i := range left {
			addr, err := r.client(i, r.sentP).Do(ctx, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", rc.MasterName).StringSlice()
			if err != nil || len(addr) != 2 || addr[0] == r.ips[gone] {
				return fmt.Errorf("sentinel %d names %v (%v)", i, addr, err)
			}
		}
		return nil
	})
	readAll("the gateway's client reads what it wrote, from the master the sentinels left chose")
	write("kube:third", 1)
	r.startPod(gone)
	r.eventually(fmt.Sprintf("pod %d ready again", gone), func() error { return r.ready(gone) })
	r.eventually("the set settled again, all three pods in it", func() error { return r.settled(r.ips[masterNow()], all, rc.MasterName) })
	readAll("the gateway's client reads everything it wrote")
}

// ---------------------------------------------------------------- network policies

// kubePeer is a pod that might knock on a door: its labels, and whether it
// runs in the kit's namespace.
type kubePeer struct {
	what   string
	labels map[string]string
	sameNS bool
}

// kubeAdmits reports whether np lets peer in on the container port named
// port, as the NetworkPolicy API defines it: some ingress rule lists the
// port (or lists none) and has a from entry that selects the peer (or has
// none). A peer in another namespace is selected only by an entry with a
// namespaceSelector; the kit's namespaces carry no labels of interest, so
// any namespaceSelector stands for "every namespace" here only when it is
// empty.
func kubeAdmits(t *testing.T, np *networkingv1.NetworkPolicy, port string, peer kubePeer) bool {
	t.Helper()
	for _, r := range np.Spec.Ingress {
		listed := len(r.Ports) == 0
		for _, p := range r.Ports {
			if p.Port == nil || (p.Port.Type == intstr.String && p.Port.StrVal == port) {
				listed = true
			}
		}
		if !listed {
			continue
		}
		if len(r.From) == 0 {
			return true
		}
		for _, f := range r.From {
			if f.IPBlock != nil {
				continue
			}
			nsOK := peer.sameNS
			if f.NamespaceSelector != nil {
				nsOK = len(f.NamespaceSelector.MatchLabels) == 0 && len(f.NamespaceSelector.MatchExpressions) == 0
			}
			podOK := f.PodSelector == nil || kubeSelects(t, f.PodSelector, peer.labels)
			if nsOK && podOK {
				return true
			}
		}
	}
	return false
}

// kubeBinds lists the addresses a loaded config listens on, by the YAML
// path that sets each.
func kubeBinds(sub string, cfg any) map[string]string {
	out := map[string]string{}
	if sub == "gateway" {
		c := cfg.(gateway.Config)
		out["listen"], out["admin_listen"] = c.Listen, c.AdminListen
		if c.Bootstrap.Listen != "" {
			out["bootstrap.listen"] = c.Bootstrap.Listen
		}
		return out
	}
	c := cfg.(gpuagent.Config)
	out["listen"], out["admin_listen"] = c.Listen, c.AdminListen
	if r := c.Receiver; r != nil {
		out["receiver.handshake_listen"], out["receiver.data_listen"] = r.HandshakeListen, r.DataListen
	}
	return out
}

// kubeOpens reports whether some ingress rule of np lists the container
// port named port.
func kubeOpens(np *networkingv1.NetworkPolicy, port string) bool {
	for _, r := range np.Spec.Ingress {
		for _, p := range r.Ports {
			if p.Port != nil && p.Port.Type == intstr.String && p.Port.StrVal == port {
				return true
			}
		}
	}
	return false
}

// TestKubeNetworkPolicies checks the kit's NetworkPolicies against its
// workloads, Services and configs: one policy selects every pod of the
// namespace and admits nothing (default deny); every workload is selected
// by exactly one other policy; every port a policy names is a container
// port of the pods it selects; every container port is opened to someone
// (a Service's target included), and so is every port the ConfigMaps'
// configs listen on (listen, admin_listen, bootstrap.listen, an agent's
// receiver); no rule is open to every peer; and each door admits exactly
// the pods that need it: the bootstrap door the encoders, the agent's TCP
// door the gateways, the admin doors the scrapers, Redis the gateways and
// itself.
//
// This stands in for kube-linter's non-isolated-pod (every workload
// selected by a policy), dangling-networkpolicy (every policy selects
// pods) and dangling-networkpolicy-rule / dangling-networkpolicypeer-
// podselector (each named peer is one the tests below admit).
func TestKubeNetworkPolicies(t *testing.T) {
	kit := kubeLoad(t)
	if len(kit.netpols) == 0 {
		t.Fatal("the kit has no NetworkPolicy: every door is open to every pod of the cluster")
	}
	policyOf := map[string]*networkingv1.NetworkPolicy{} // workload -> its policy
	denyAll := 0
	for _, np := range kit.netpols {
		if !slices.Equal(np.Spec.PolicyTypes, []networkingv1.PolicyType{networkingv1.PolicyTypeIngress}) {
			t.Errorf("NetworkPolicy %s: policyTypes %v, want [Ingress]", np.Name, np.Spec.PolicyTypes)
		}
		if len(np.Spec.PodSelector.MatchLabels) == 0 && len(np.Spec.PodSelector.MatchExpressions) == 0 {
			// Every pod of the namespace: the default deny.
			denyAll++
			if len(np.Spec.Ingress) > 0 {
				t.Errorf("NetworkPolicy %s selects every pod of the namespace and admits %d rules: a default deny admits nothing", np.Name, len(np.Spec.Ingress))
			}
			continue
		}
		var selected []kubeWorkload
		for _, w := range kit.workloads {
			if len(np.Spec.PodSelector.MatchLabels) > 0 && kubeSelects(t, &np.Spec.PodSelector, w.pod.Labels) {
				selected = append(selected, w)
			}
		}
		if len(selected) != 1 {
			t.Errorf("NetworkPolicy %s selects %d workloads, want 1", np.Name, len(selected))
			continue
		}
		w := selected[0]
		if prev, dup := policyOf[w.String()]; dup {
			t.Errorf("%s is selected by NetworkPolicies %s and %s", w, prev.Name, np.Name)
		}
		policyOf[w.String()] = np
		ports := map[string]bool{}
		for _, c := range w.pod.Spec.Containers {
			for _, cp := range c.Ports {
				ports[cp.Name] = true
			}
		}
		opened := map[string]bool{}
		for i, r := range np.Spec.Ingress {
			if len(r.From) == 0 {
				t.Errorf("NetworkPolicy %s ingress[%d] has no from: it admits every pod and address", np.Name, i)
			}
			for j, f := range r.From {
				if f.IPBlock != nil {
					t.Errorf("NetworkPolicy %s ingress[%d].from[%d] admits an ipBlock: pods are named by labels", np.Name, i, j)
				}
				if f.PodSelector == nil || len(f.PodSelector.MatchLabels) == 0 {
					t.Errorf("NetworkPolicy %s ingress[%d].from[%d] selects every pod of its namespaces", np.Name, i, j)
				}
			}
			if len(r.Ports) == 0 {
				t.Errorf("NetworkPolicy %s ingress[%d] lists no port: it opens every port", np.Name, i)
			}
			for _, p := range r.Ports {
				switch {
				case p.Port == nil || p.Port.Type != intstr.String:
					t.Errorf("NetworkPolicy %s ingress[%d]: port %v is not a container port's name", np.Name, i, p.Port)
				case !ports[p.Port.StrVal]:
					t.Errorf("NetworkPolicy %s ingress[%d]: port %s is not a container port of %s", np.Name, i, p.Port.StrVal, w)
				default:
					opened[p.Port.StrVal] = true
				}
				if p.Protocol == nil || *p.Protocol != corev1.ProtocolTCP {
					t.Errorf("NetworkPolicy %s ingress[%d] port %v: protocol must be TCP", np.Name, i, p.Port)
				}
			}
		}
		for name := range ports {
			if !opened[name] {
				t.Errorf("NetworkPolicy %s closes %s's port %s to everyone", np.Name, w, name)
			}
		}
		for _, s := range kit.services {
			if !kubeSubset(s.Spec.Selector, w.pod.Labels) {
				continue
			}
			for _, sp := range s.Spec.Ports {
				if !opened[sp.TargetPort.StrVal] {
					t.Errorf("Service %s port %s targets %s, which NetworkPolicy %s opens to no one", s.Name, sp.Name, sp.TargetPort.String(), np.Name)
				}
			}
		}
	}
	if denyAll != 1 {
		t.Errorf("%d NetworkPolicies select every pod of the namespace, want one default deny (podSelector {}, no ingress rule)", denyAll)
	}
	for _, w := range kit.workloads {
		if policyOf[w.String()] == nil {
			t.Errorf("%s is selected by no NetworkPolicy of its own: the default deny closes all its ports", w)
		}
	}

	// The ports the configs of the ConfigMaps listen on, each a named
	// container port that its workload's policy opens.
	listens := 0
	for _, e := range kit.encgateContainers() {
		np := policyOf[e.w.String()]
		if np == nil || !kubeRunsSubcommand(e.c) {
			continue
		}
		sub := e.c.Args[0]
		got, err := kubeParseArgs(e.c.Args[1:], map[string]bool{"config": true, "check": false})
		if err != nil || len(got["config"]) != 1 {
			t.Fatalf("%s: args %q: %v", e, e.c.Args, err)
		}
		content, err := kit.configMapFile(&e.w.pod.Spec, e.c, got["config"][0])
		if err != nil {
			t.Fatal(err)
		}
		_, cfg := kit.localConfig(t, e, content, nil)
		for field, addr := range kubeBinds(sub, cfg) {
			listens++
			_, port := kubePort(t, addr)
			i := slices.IndexFunc(e.c.Ports, func(cp corev1.ContainerPort) bool { return cp.ContainerPort == port })
			switch {
			case i < 0 || e.c.Ports[i].Name == "":
				t.Errorf("%s: %s %s is no named container port, so no NetworkPolicy rule can open it", e, field, addr)
			case !kubeOpens(np, e.c.Ports[i].Name):
				t.Errorf("%s: %s %s (port %s) is opened by no rule of NetworkPolicy %s", e, field, addr, e.c.Ports[i].Name, np.Name)
			}
		}
	}
	if listens < 5 {
		t.Errorf("checked %d listeners of the configs, want at least the gateway's three and the agent's two", listens)
	}

	gw := kit.workload(t, "Deployment", "encgate-gateway")
	agent := kit.workload(t, "DaemonSet", "encgate-agent")
	redis := kit.workload(t, "StatefulSet", "encgate-redis")
	peers := map[string]kubePeer{
		"gateway":           {"a gateway pod", gw.pod.Labels, true},
		"gateway elsewhere": {"a pod with the gateway's labels in another namespace", gw.pod.Labels, false},
		"agent":             {"an agent pod", agent.pod.Labels, true},
		"redis":             {"a Redis pod", redis.pod.Labels, true},
		"client":            {"a language server", map[string]string{"encgate.io/client": "true"}, false},
		"encoder":           {"an encoder", map[string]string{"encgate.io/encoder": "true"}, false},
		"scraper":           {"Prometheus", map[string]string{"encgate.io/scraper": "true"}, false},
		"stranger":          {"an unlabelled pod in the kit's namespace", map[string]string{"app": "other"}, true},
		"stranger away":     {"an unlabelled pod elsewhere", map[string]string{"app": "other"}, false},
	}
	doors := []struct {
		w     kubeWorkload
		port  string
		admit []string
	}{
		{gw, "http", []string{"client"}},
		{gw, "bootstrap", []string{"encoder"}},
		{gw, "admin", []string{"scraper"}},
		{agent, "control", []string{"gateway"}},
		{agent, "admin", []string{"scraper"}},
		{redis, "redis", []string{"gateway", "redis"}},
		{redis, "sentinel", []string{"gateway", "redis"}},
	}
	for _, d := range doors {
		np := policyOf[d.w.String()]
		if np == nil {
			continue
		}
		for key, peer := range peers {
			want := slices.Contains(d.admit, key)
			if got := kubeAdmits(t, np, d.port, peer); got != want {
				t.Errorf("%s's port %s: %s admitted %v, want %v (NetworkPolicy %s)", d.w, d.port, peer.what, got, want, np.Name)
			}
		}
	}
}
